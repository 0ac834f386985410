"""Trusted proxies: what a proxy in front of us may tell the application.

Owns: which peers are trusted (``--forwarded-allow-ips``: addresses and CIDR networks, ``*``;
unix-socket peers always), and, for a request from a trusted peer only, the scheme it was
made with (``wsgi.url_scheme`` from RFC 7239 ``Forwarded: proto=``, else ``X-Forwarded-Proto``
or ``X-Forwarded-Ssl: on``) and, opt-in (``--forwarded-for``), the client's address
(``REMOTE_ADDR`` from ``Forwarded: for=`` or ``X-Forwarded-For``; the peer's own address is
kept in ``forkserve.peer_addr``). A request from any other peer is left as it came: a client
that fakes ``X-Forwarded-Proto: https`` stays ``http``.

Which hop to believe: each proxy appends what it saw, so the right-most value is the one our
trusted peer wrote. The client's address is the right-most hop that is not itself a trusted
proxy (a client can prepend anything it likes, never append after our proxy); the scheme is
the right-most one given. With ``*`` every hop is trusted, so the left-most address is taken.

Pure: no sockets; imports only the standard library.
"""

from __future__ import annotations

import ipaddress
from typing import Any

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
SCHEMES = ("http", "https")


class TrustedProxies:
    """One per worker, from its settings (a HUP's new workers get the new list)."""

    def __init__(self, allow: list[str], forwarded_for: bool) -> None:
        self.everyone = "*" in allow
        self.forwarded_for = forwarded_for
        self.networks: list[Network] = []
        self.exact: set[str] = set()  # the common case (127.0.0.1, ::1): a set lookup
        for item in allow:
            if item == "*":
                continue
            network = ipaddress.ip_network(item.strip("[]"), strict=False)
            if network.num_addresses == 1:
                self.exact.add(str(network.network_address))
            else:
                self.networks.append(network)

    def trusts_peer(self, addr: Any) -> bool:
        """An accepted peer (``accept()``'s address): a unix socket's is always trusted."""
        if not isinstance(addr, tuple):
            return True
        return self.trusts(addr[0])

    def trusts(self, host: str) -> bool:
        if self.everyone or host in self.exact:
            return True
        if not self.networks and not host.startswith("::ffff:"):
            return False  # (a set lookup was all: the usual case)
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:10.0.0.1 on a dual-stack listener
            if str(address) in self.exact:
                return True
        return any(address in network for network in self.networks)

    def apply(self, environ: dict[str, Any]) -> None:
        """A request from a trusted peer: its scheme and (opt-in) its client's address."""
        forwarded = environ.get("HTTP_FORWARDED")
        if forwarded is not None:
            elements = parse_forwarded(forwarded)
            proto = next((e["proto"] for e in reversed(elements) if "proto" in e), None)
            hops = [e.get("for", "") for e in elements]
        else:
            x_proto = environ.get("HTTP_X_FORWARDED_PROTO")
            x_ssl = environ.get("HTTP_X_FORWARDED_SSL")
            x_for = environ.get("HTTP_X_FORWARDED_FOR")
            if x_proto is None and x_ssl is None and x_for is None:
                return  # the usual request: nothing forwarded, four dict lookups in all
            proto = last_item(x_proto)
            if proto is None and last_item(x_ssl) == "on":
                proto = "https"
            hops = split_list(x_for)
        if proto is not None and proto.lower() in SCHEMES:
            environ["wsgi.url_scheme"] = proto.lower()
        if self.forwarded_for and hops:
            client = self.client_of(hops)
            if client is not None:
                environ["forkserve.peer_addr"] = environ["REMOTE_ADDR"]
                environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = client

    def client_of(self, hops: list[str]) -> tuple[str, str] | None:
        """The right-most hop that is not a trusted proxy (all trusted: the left-most); None
        when that hop is not an address (``unknown``, an obfuscated ``_name``)."""
        chosen = None
        for hop in reversed(hops):
            chosen = host_port(hop)
            if chosen is None or not self.trusts(chosen[0]):
                break
        return chosen


def parse_forwarded(value: str) -> list[dict[str, str]]:
    """RFC 7239: ``for=192.0.2.60;proto=http, for="[2001:db8::1]:4711"`` -> one dict per
    element, keys lower-cased, quotes removed. Malformed pairs are skipped."""
    elements = []
    for element in value.split(","):
        pairs: dict[str, str] = {}
        for pair in element.split(";"):
            name, sep, val = pair.partition("=")
            if sep:
                pairs[name.strip().lower()] = val.strip().strip('"')
        elements.append(pairs)
    return elements


def split_list(value: str | None) -> list[str]:
    return [] if not value else [item.strip() for item in value.split(",") if item.strip()]


def last_item(value: str | None) -> str | None:
    items = split_list(value)
    return items[-1].lower() if items else None


def host_port(hop: str) -> tuple[str, str] | None:
    """``1.2.3.4``, ``1.2.3.4:80``, ``[::1]:80``, ``::1`` -> (host, port or "0"); None when
    the hop is not an IP address."""
    hop = hop.strip().strip('"')
    port = "0"
    if hop.startswith("["):
        host, _, rest = hop[1:].partition("]")
        if rest.startswith(":"):
            port = rest[1:]
    elif hop.count(":") == 1:
        host, _, port = hop.partition(":")
    else:
        host = hop
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host, port if port.isdigit() else "0"
