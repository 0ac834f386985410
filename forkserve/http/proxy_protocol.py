"""The PROXY protocol, v1 and v2 (HAProxy's spec, doc/proxy-protocol.txt): the header an L4
balancer (AWS NLB, HAProxy ``send-proxy``) sends before the client's bytes, saying whose
connection this is. Sans-IO: bytes in, (header length, source address) out.

``parse(data)`` is asked with what has arrived so far:
- ``NOT_PROXY``: the connection does not start with a PROXY header (plain HTTP: auto-detected);
- ``None``: it may, and more bytes are needed (the caller bounds the wait);
- ``(consumed, source)``: a whole header of ``consumed`` bytes; ``source`` is the client's
  (host, port), or None where the header names none (v1 ``UNKNOWN``, v2 ``LOCAL`` — a
  balancer's own health check — or an address family other than TCP over IPv4/IPv6);
- ``ProxyProtocolError``: it is a PROXY header, and a broken one.
"""

from __future__ import annotations

import ipaddress
import struct

V1_PREFIX = b"PROXY "
V1_MAX = 107  # the spec's bound for a v1 line, CRLF included
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_MAX = 16 + 4096  # the fixed part and the addresses with TLVs (AWS sends a few hundred bytes)
NOT_PROXY = 0
Source = tuple[str, str] | None


class ProxyProtocolError(Exception):
    pass


def parse(data: bytes) -> int | tuple[int, Source] | None:
    if data[:len(V2_SIGNATURE)] == V2_SIGNATURE[:len(data)]:
        return None if len(data) < 16 else _v2(data)
    if data[:len(V1_PREFIX)] == V1_PREFIX[:len(data)]:
        return None if len(data) < len(V1_PREFIX) else _v1(data)
    return NOT_PROXY


def _v1(data: bytes) -> tuple[int, Source] | None:
    end = data.find(b"\r\n", 0, V1_MAX)
    if end < 0:
        if len(data) >= V1_MAX:
            raise ProxyProtocolError("a PROXY v1 line longer than 107 bytes")
        return None
    parts = data[:end].decode("ascii", "replace").split(" ")
    if len(parts) >= 2 and parts[1] == "UNKNOWN":
        return end + 2, None
    if len(parts) != 6 or parts[1] not in ("TCP4", "TCP6"):
        raise ProxyProtocolError(f"a malformed PROXY v1 line: {data[:end]!r}")
    _, family, source, _, source_port, _ = parts
    try:
        address = ipaddress.ip_address(source)
        port = int(source_port)
    except ValueError:
        raise ProxyProtocolError(f"a malformed PROXY v1 address: {data[:end]!r}") from None
    if (address.version == 4) != (family == "TCP4") or not 0 <= port <= 65535:
        raise ProxyProtocolError(f"a malformed PROXY v1 address: {data[:end]!r}")
    return end + 2, (str(address), str(port))


def _v2(data: bytes) -> tuple[int, Source] | None:
    version_command, family, length = data[12], data[13], struct.unpack_from("!H", data, 14)[0]
    if version_command >> 4 != 2 or version_command & 0x0F not in (0, 1):
        raise ProxyProtocolError(f"a PROXY v2 header with version/command {version_command:#x}")
    if 16 + length > V2_MAX:
        raise ProxyProtocolError(f"a PROXY v2 header of {16 + length} bytes")
    if len(data) < 16 + length:
        return None
    consumed = 16 + length
    if version_command & 0x0F == 0:  # LOCAL: the balancer's own connection (a health check)
        return consumed, None
    body = data[16:consumed]
    if family == 0x11 and length >= 12:  # TCP over IPv4: src, dst, src port, dst port
        return consumed, (str(ipaddress.IPv4Address(body[0:4])),
                          str(struct.unpack_from("!H", body, 8)[0]))
    if family == 0x21 and length >= 36:  # TCP over IPv6
        return consumed, (str(ipaddress.IPv6Address(body[0:16])),
                          str(struct.unpack_from("!H", body, 32)[0]))
    return consumed, None  # UNSPEC, UDP, unix: nothing we can use as REMOTE_ADDR
