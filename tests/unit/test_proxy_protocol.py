"""The PROXY protocol parser (forkserve.http.proxy_protocol), v1 and v2, whole and byte by
byte, and Connection taking a header off a connection's first bytes. Pure but for a
socketpair."""

from __future__ import annotations

import struct
import time
from typing import Any

import pytest

from forkserve.http.proxy_protocol import NOT_PROXY, V2_SIGNATURE, ProxyProtocolError, parse

REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def v2(command: int = 1, family: int = 0x11, body: bytes | None = None) -> bytes:
    if body is None:
        body = (bytes([203, 0, 113, 7]) + bytes([127, 0, 0, 1]) + struct.pack("!HH", 51234, 80))
    return V2_SIGNATURE + bytes([0x20 | command, family]) + struct.pack("!H", len(body)) + body


V6_BODY = (bytes.fromhex("20010db8000000000000000000000009") + bytes(15) + b"\x01"
           + struct.pack("!HH", 4433, 443))
CASES = [
    (b"PROXY TCP4 203.0.113.7 127.0.0.1 51234 80\r\n", ("203.0.113.7", "51234")),
    (b"PROXY TCP6 2001:db8::9 ::1 4433 443\r\n", ("2001:db8::9", "4433")),
    (b"PROXY UNKNOWN\r\n", None),
    (b"PROXY UNKNOWN ffff::1 ffff::2 1 2\r\n", None),
    (v2(), ("203.0.113.7", "51234")),
    (v2(family=0x21, body=V6_BODY), ("2001:db8::9", "4433")),
    (v2(command=0, family=0, body=b""), None),  # LOCAL: the balancer's health check
    (v2(family=0x11, body=v2()[16:] + b"\x03\x00\x04abcd"), ("203.0.113.7", "51234")),  # a TLV
    (v2(family=0x31, body=bytes(216)), None),  # unix: nothing usable
]


@pytest.mark.parametrize("header, source", CASES)
def test_whole_and_byte_by_byte(header: bytes, source: Any) -> None:
    assert parse(header + REQUEST) == (len(header), source)
    for cut in range(1, len(header)):
        assert parse(header[:cut]) is None, cut  # not yet known: more bytes


@pytest.mark.parametrize("data", [REQUEST, b"POST / HTTP/1.1\r\n", b"\r\nGET / HTTP/1.1\r\n",
                                  b"PRI * HTTP/2.0\r\n"])
def test_anything_else_is_not_proxy(data: bytes) -> None:
    assert parse(data) == NOT_PROXY


@pytest.mark.parametrize("header", [
    b"PROXY TCP4 203.0.113.7 127.0.0.1 51234\r\n",
    b"PROXY TCP4 ::1 127.0.0.1 1 2\r\n",  # the family says v4, the address is v6
    b"PROXY TCP4 203.0.113.7 127.0.0.1 99999 80\r\n",
    b"PROXY HTTP 1 2 3 4\r\n",
    b"PROXY " + b"x" * 120,  # no CRLF within the spec's 107 bytes
    V2_SIGNATURE + bytes([0x31, 0x11, 0, 12]) + bytes(12),  # version 3
    V2_SIGNATURE + bytes([0x22, 0x11, 0, 12]) + bytes(12),  # command 2
    V2_SIGNATURE + bytes([0x21, 0x11, 0xFF, 0xFF]),  # 64 KiB of addresses
])
def test_broken_headers(header: bytes) -> None:
    with pytest.raises(ProxyProtocolError):
        parse(header)


def test_a_connection_takes_the_header_off_sent_in_pieces(pair: Any) -> None:
    conn, client = pair(trusted=True, proxy_protocol=True)
    header = b"PROXY TCP4 203.0.113.7 127.0.0.1 51234 80\r\n"
    for piece in (header[:5], header[5:20], header[20:] + REQUEST[:10], REQUEST[10:]):
        client.sendall(piece)  # (each may be read alone or with the next: both are right)
    request = conn.read_head(time.monotonic() + 2)
    assert request is not None and request.target == b"/"
    assert conn.remote == ("203.0.113.7", "51234") and conn.peer == ("127.0.0.1", "40000")


def test_plain_http_is_served_as_it_is(pair: Any) -> None:
    conn, client = pair(trusted=True, proxy_protocol=True)
    client.sendall(REQUEST)
    assert conn.read_head(time.monotonic() + 2) is not None
    assert conn.remote == ("127.0.0.1", "40000") and conn.peer is None


def test_an_untrusted_peer_may_not_send_one(pair: Any) -> None:
    conn, client = pair(trusted=False, proxy_protocol=True)
    client.sendall(b"PROXY TCP4 1.2.3.4 127.0.0.1 1 80\r\n" + REQUEST)
    with pytest.raises(ProxyProtocolError, match="not a trusted proxy"):
        conn.read_head(time.monotonic() + 2)


def test_a_header_alone_is_not_yet_a_request(pair: Any) -> None:
    """A balancer's pre-opened connection: no 408 when it times out (nothing was received)."""
    from forkserve.workers.connection import Timeout
    conn, client = pair(trusted=True, proxy_protocol=True)
    client.sendall(v2())
    with pytest.raises(Timeout):
        conn.read_head(time.monotonic() + 0.1)
    assert not conn.received and conn.remote == ("203.0.113.7", "51234")


def test_off_a_proxy_header_is_refused_as_an_unknown_method(pair: Any) -> None:
    """Without --proxy-protocol the header is a request line with the method PROXY: refused
    before the app, as any unknown method is (501)."""
    from forkserve.http import HTTPError
    conn, client = pair(trusted=True)
    client.sendall(b"PROXY TCP4 1.2.3.4 127.0.0.1 1 80\r\n" + REQUEST)
    with pytest.raises(HTTPError) as caught:
        conn.read_head(time.monotonic() + 2)
    assert caught.value.status == 501
