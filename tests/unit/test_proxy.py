"""Trusted proxies (forkserve.proxy): who is trusted, and what a trusted proxy's headers change
in the environ. The settings' parsing (forkserve.config) too. Pure: no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from forkserve.config import ConfigError, parse_args, resolve
from forkserve.proxy import TrustedProxies, host_port, parse_forwarded

DEFAULT = ["127.0.0.1", "::1"]


def environ(**headers: str) -> dict[str, Any]:
    env: dict[str, Any] = {"wsgi.url_scheme": "http", "REMOTE_ADDR": "127.0.0.1",
                           "REMOTE_PORT": "40000"}
    env.update({f"HTTP_{name.upper()}": value for name, value in headers.items()})
    return env


@pytest.mark.parametrize("allow, host, trusted", [
    (DEFAULT, "127.0.0.1", True),
    (DEFAULT, "::1", True),
    (DEFAULT, "127.0.0.2", False),
    (DEFAULT, "10.0.0.1", False),
    (["10.0.0.0/8"], "10.20.30.40", True),
    (["10.0.0.0/8"], "11.0.0.1", False),
    (["10.0.0.0/8"], "::ffff:10.1.2.3", True),  # a dual-stack listener's IPv4 peer
    (["10.0.0.1"], "::ffff:10.0.0.1", True),
    (["2001:db8::/32"], "2001:db8::5", True),
    (["*"], "203.0.113.9", True),
    ([], "127.0.0.1", False),
    (["10.0.0.0/8"], "not-an-address", False),
])
def test_who_is_trusted(allow: list[str], host: str, trusted: bool) -> None:
    assert TrustedProxies(allow, False).trusts(host) is trusted


def test_a_unix_socket_peer_is_always_trusted() -> None:
    proxies = TrustedProxies(["10.0.0.1"], False)
    assert proxies.trusts_peer("") is True  # accept() on a unix socket gives no address
    assert proxies.trusts_peer(("127.0.0.1", 5)) is False


@pytest.mark.parametrize("headers, scheme", [
    ({}, "http"),
    ({"x_forwarded_proto": "https"}, "https"),
    ({"x_forwarded_proto": "HTTPS"}, "https"),
    ({"x_forwarded_proto": "https, http"}, "http"),  # the right-most: our proxy's own word
    ({"x_forwarded_proto": "gopher"}, "http"),  # not a scheme we speak: ignored
    ({"x_forwarded_ssl": "on"}, "https"),
    ({"x_forwarded_ssl": "off"}, "http"),
    ({"forwarded": "for=192.0.2.60;proto=https;by=203.0.113.43"}, "https"),
    ({"forwarded": 'for=192.0.2.60;proto=https, for="[2001:db8::1]"'}, "https"),
    # Forwarded wins over the X- headers when both came (it is the standard one).
    ({"forwarded": "proto=http", "x_forwarded_proto": "https"}, "http"),
])
def test_the_scheme_from_a_trusted_proxy(headers: dict[str, str], scheme: str) -> None:
    env = environ(**headers)
    TrustedProxies(DEFAULT, False).apply(env)
    assert env["wsgi.url_scheme"] == scheme


def test_the_client_address_is_opt_in() -> None:
    env = environ(x_forwarded_for="203.0.113.7")
    TrustedProxies(DEFAULT, False).apply(env)
    assert env["REMOTE_ADDR"] == "127.0.0.1" and "forkserve.peer_addr" not in env


@pytest.mark.parametrize("allow, header, client", [
    (DEFAULT, "203.0.113.7", ("203.0.113.7", "0")),
    # A client can prepend anything: the right-most hop our proxy did not vouch for counts.
    (DEFAULT, "1.1.1.1, 203.0.113.7", ("203.0.113.7", "0")),
    (["127.0.0.1", "10.0.0.0/8"], "203.0.113.7, 10.0.0.5", ("203.0.113.7", "0")),
    (["*"], "198.51.100.1, 203.0.113.7", ("198.51.100.1", "0")),  # all trusted: left-most
    (DEFAULT, "203.0.113.7:8443", ("203.0.113.7", "8443")),  # Azure's ip:port form
    (DEFAULT, "[2001:db8::9]:443", ("2001:db8::9", "443")),
    (DEFAULT, "2001:db8::9", ("2001:db8::9", "0")),
])
def test_the_client_from_x_forwarded_for(allow: list[str], header: str,
                                         client: tuple[str, str]) -> None:
    env = environ(x_forwarded_for=header)
    TrustedProxies(allow, True).apply(env)
    assert (env["REMOTE_ADDR"], env["REMOTE_PORT"]) == client
    assert env["forkserve.peer_addr"] == "127.0.0.1"


@pytest.mark.parametrize("header, client", [
    ('for=192.0.2.60;proto=http;by=203.0.113.43', "192.0.2.60"),
    ('for="[2001:db8:cafe::17]:4711"', "2001:db8:cafe::17"),
    ('For=192.0.2.43, for=198.51.100.17', "198.51.100.17"),
])
def test_the_client_from_forwarded(header: str, client: str) -> None:
    env = environ(forwarded=header)
    TrustedProxies(DEFAULT, True).apply(env)
    assert env["REMOTE_ADDR"] == client


@pytest.mark.parametrize("header", ["unknown", "_hidden", "for=unknown", ""])
def test_a_hop_that_is_no_address_leaves_the_peer(header: str) -> None:
    env = environ(x_forwarded_for=header) if "=" not in header else environ(forwarded=header)
    TrustedProxies(DEFAULT, True).apply(env)
    assert env["REMOTE_ADDR"] == "127.0.0.1" and "forkserve.peer_addr" not in env


def test_forwarded_parsing_and_hops() -> None:
    assert parse_forwarded('for=1.2.3.4;Proto=HTTPS, for="[::1]:80";x') == [
        {"for": "1.2.3.4", "proto": "HTTPS"}, {"for": "[::1]:80"}]
    assert host_port("_obfuscated") is None
    assert host_port('"10.0.0.1:80"') == ("10.0.0.1", "80")


# -- the settings ---------------------------------------------------------------------------------
def config(argv: list[str], env: dict[str, str] | None = None) -> Any:
    return resolve(parse_args([*argv, "tests.apps.basic:app"], "test")[0], env or {})


def test_the_defaults_trust_only_loopback() -> None:
    c = config([])
    assert c.forwarded_allow_ips == DEFAULT and c.forwarded_for is False


def test_a_list_from_the_command_line_and_gunicorns_variable() -> None:
    assert config(["--forwarded-allow-ips", "10.0.0.0/8, 192.168.1.1"]).forwarded_allow_ips == \
        ["10.0.0.0/8", "192.168.1.1"]
    moved = config([], {"FORWARDED_ALLOW_IPS": "*"})
    assert moved.forwarded_allow_ips == ["*"] and moved.sources["forwarded_allow_ips"] == "env"
    # Ours wins over gunicorn's; the command line over both.
    both = {"FORWARDED_ALLOW_IPS": "*", "FORKSERVE_FORWARDED_ALLOW_IPS": "10.0.0.1"}
    assert config([], both).forwarded_allow_ips == ["10.0.0.1"]
    assert config(["--forwarded-allow-ips", "::1"], both).forwarded_allow_ips == ["::1"]


@pytest.mark.parametrize("argv, env, where", [
    (["--forwarded-allow-ips", "10.0.0.0/33"], {}, "--forwarded-allow-ips"),
    (["--forwarded-allow-ips", "localhost"], {}, "--forwarded-allow-ips"),
    ([], {"FORWARDED_ALLOW_IPS": "10.0.0.300"}, "FORWARDED_ALLOW_IPS"),
])
def test_a_malformed_entry_is_one_clear_line(argv: list[str], env: dict[str, str],
                                             where: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(argv, env)
    message = str(caught.value)
    assert message.startswith(f"{where}: expected IP addresses or CIDR networks") and "\n" not in message
