"""Hypothesis strategies for HTTP/1.1 requests: well-formed ones, and structured-but-mutated ones
(each part drawn from valid values and near misses: a bad version, a control character in a
value, a chunk size that lies, a stray `*`), pipelines of them, byte-level mutations, and read
splits. Shared by the unit and integration property tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from forkserve.http import Limits

# Small limits, so that the limits are reached by inputs hypothesis likes to make (short).
SMALL_LIMITS = Limits(request_line=96, fields=8, field_size=80, body=256)
LIMITS = st.sampled_from([Limits(), SMALL_LIMITS])

METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]
TCHAR = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
PCHAR = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=:@%/"


@dataclass(frozen=True)
class Built:
    """A request as built: its bytes, and (when it was built well-formed) what a parser must
    make of it."""

    data: bytes
    method: str
    target: bytes
    body: bytes | None  # None: not well-formed, no claim on what it parses to


def _text(alphabet: str, min_size: int = 0, max_size: int = 12) -> st.SearchStrategy[bytes]:
    return st.text(alphabet, min_size=min_size, max_size=max_size).map(lambda s: s.encode("ascii"))


tokens = _text(TCHAR, 1, 10)
paths = st.builds(lambda a, q: b"/" + a + (b"?" + q if q is not None else b""),
                  _text(PCHAR, 0, 20), st.none() | _text(PCHAR + "?", 0, 10))
good_targets = paths | st.sampled_from([b"http://example.com/a?b", b"https://h:8443/"])
# Near misses of the request target: asterisk forms (only a lone * with OPTIONS is valid),
# authority form, origin forms with bytes RFC 3986 does not allow.
bad_targets = st.sampled_from([b"*", b"*/x", b"**", b"*.x", b"example.com:80", b"a/b", b"",
                               b"/\x7f", b"/\x80", b"/a b", b"/#", b"http://", b"//x"])
versions = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"])
bad_versions = st.sampled_from([b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9", b"http/1.1", b"HTTP/1",
                                b"RTSP/1.0", b"ICE/1.0", b"HTTP/1.1 ", b"", b"HTTP/11"])
field_values = _text(TCHAR + " \t\"(),/:;<=>?@[\\]{}", 0, 20)
bad_field_values = st.sampled_from([b"a\x00b", b"a\x01", b"\x7f", b"a\rb", b"a\nb", b"x\x1b[0m",
                                    b"a\x0bb", b"\xff\xfe", b" lead", b"trail \t"])
# Fields that mean something to the parser or the server, as they may come.
meaningful = st.sampled_from([
    (b"Connection", b"close"), (b"Connection", b"keep-alive"), (b"Connection", b"keep-alive, close"),
    (b"Connection", b"Upgrade"), (b"Upgrade", b"websocket"), (b"Expect", b"100-continue"),
    (b"Host", b"other"), (b"Host", b"bad host"), (b"Host", b"[::1]:8080"), (b"Host", b""),
    (b"Content-Length", b"3"), (b"Content-Length", b"-1"), (b"Content-Length", b"+3"),
    (b"Content-Length", b"99999999999999999999"), (b"Content-Length", b"0x10"),
    (b"Transfer-Encoding", b"chunked"), (b"Transfer-Encoding", b"gzip, chunked"),
    (b"Transfer-Encoding", b"chunked, chunked"), (b"Transfer-Encoding", b"identity"),
    (b"Content-Type", b"text/plain"), (b"Trailer", b"X-T"), (b"TE", b"trailers"),
])


@st.composite
def chunked(draw: st.DrawFn, body: bytes, well_formed: bool) -> bytes:
    """``body`` in chunks, maybe with extensions and trailers; or, not ``well_formed``, with
    a size that lies, a bad extension, a missing CRLF, or a forbidden trailer."""
    out, at = [], 0
    while at < len(body):
        size = draw(st.integers(1, max(1, len(body) - at)))
        ext = draw(st.sampled_from([b"", b"", b";a=b", b";x", b" ;y"]))
        out.append(b"%x%s\r\n%s\r\n" % (size, ext, body[at:at + size]))
        at += size
    trailers = draw(st.sampled_from([b"", b"", b"X-T: 1\r\n"]))
    out.append(b"0\r\n" + trailers + b"\r\n")
    data = b"".join(out)
    if not well_formed:
        flaw = draw(st.sampled_from([
            b"5\r\nab\r\n0\r\n\r\n", b"zz\r\n", b"1;=\r\nx\r\n0\r\n\r\n", b"0\r\nHost: a\r\n\r\n",
            b"0\r\nContent-Length: 1\r\n\r\n", b"-1\r\n", b"1\r\nxy0\r\n\r\n", b"0\n\n",
            b"ffffffffffffffffff\r\n", b"0\r\nX: \x01\r\n\r\n", b"1 \r\nx\r\n0\r\n\r\n",
        ]))
        data = draw(st.sampled_from([flaw, data[: len(data) // 2] + flaw]))
    return data


@st.composite
def requests(draw: st.DrawFn, well_formed: bool | None = None) -> Built:
    """One request. ``well_formed``: True, only valid requests (and what they must parse
    to); False or None (either), near misses in any part."""
    good = draw(st.booleans()) if well_formed is None else well_formed
    # Which part goes wrong (only when not good); several may.
    flaws = set(draw(st.lists(st.sampled_from(["method", "target", "version", "field",
                                                "framing", "line"]), min_size=1, max_size=2))
                ) if not good else set()
    method = draw(st.sampled_from(METHODS) if "method" not in flaws
                  else st.sampled_from(["FOO", "get", "PRI", "CONNECT", "G\x00T", "", "DESCRIBE",
                                        "GET\t", "\x16\x03\x01"]) | tokens.map(bytes.decode))
    target = draw(good_targets if "target" not in flaws else bad_targets)
    if method == "OPTIONS" and good:
        target = draw(st.sampled_from([target, b"*"]))
    version = draw(versions if "version" not in flaws else bad_versions)
    sep = draw(st.sampled_from([b" "] if "line" not in flaws else [b"  ", b"\t", b" \t", b""]))
    line_end = draw(st.sampled_from([b"\r\n"] if "line" not in flaws else [b"\n", b"\r", b"\r\r\n"]))
    fields: list[tuple[bytes, bytes]] = []
    if version == b"HTTP/1.1" or draw(st.booleans()):
        fields.append((b"Host", draw(st.sampled_from([b"example.com", b"127.0.0.1:8000", b"a"]))))
    fields += draw(st.lists(st.tuples(tokens.filter(lambda n: n.lower() not in (
        b"host", b"content-length", b"transfer-encoding", b"connection", b"upgrade", b"expect",
        b"content-type")), field_values.map(lambda v: v.strip(b" \t"))), max_size=3))
    if "field" in flaws:
        fields.append(draw(st.tuples(tokens, bad_field_values) | meaningful
                           | st.tuples(st.sampled_from([b"X Y", b"X:", b"", b"\x01", b"X\t"]),
                                       field_values)))
    elif draw(st.booleans()) and good:
        extra = draw(st.sampled_from([(b"Connection", b"close"), (b"Connection", b"keep-alive"),
                                      (b"Content-Type", b"text/plain"),
                                      (b"Expect", b"100-continue")]))
        if extra[0] != b"Expect" or version == b"HTTP/1.1":
            fields.append(extra)
    body = draw(st.binary(max_size=40)) if method in ("POST", "PUT", "PATCH") else b""
    framing = draw(st.sampled_from(["length", "chunked"] if version == b"HTTP/1.1" else ["length"]))
    payload = b""
    if body or framing == "chunked" and method in ("POST", "PUT", "PATCH"):
        if framing == "chunked":
            fields.append((b"Transfer-Encoding", b"chunked"))
            payload = draw(chunked(body, "framing" not in flaws))
        else:
            fields.append((b"Content-Length", str(len(body)).encode()))
            payload = body
    if "framing" in flaws:
        fields.append(draw(st.sampled_from([(b"Content-Length", b"1"), (b"Content-Length", b"x"),
                                            (b"Transfer-Encoding", b"chunked"),
                                            (b"Transfer-Encoding", b"gzip")])))
        if framing != "chunked":
            payload = draw(st.sampled_from([payload, payload[:-1], payload + b"zz"]))
    fields = draw(st.permutations(fields))
    sp = draw(st.sampled_from([b": ", b":", b":\t", b":  "]))
    head = method.encode("latin-1") + sep + target + sep + version + line_end
    head += b"".join(name + sp + value + b"\r\n" for name, value in fields) + b"\r\n"
    return Built(head + payload, method, target, body if good else None)


pipelines = st.lists(requests(), min_size=1, max_size=4)
good_pipelines = st.lists(requests(well_formed=True), min_size=1, max_size=4)


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with a few bytes flipped, inserted, deleted or duplicated."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "insert", "delete", "repeat"]))
        if kind == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(st.sampled_from([b"\r\n", b"\n", b" ", b"\x00", b":", b";", b"*",
                                                b"0", b"\t", b"\r", b"HEAD / HTTP/1.1\r\n"]))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 4))]
        else:
            data[at:at] = data[at:at + draw(st.integers(1, 16))]
    return bytes(data)


@st.composite
def splits(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` in the pieces it is read in: random cuts, or a byte at a time."""
    if len(data) < 2:
        return [data]
    if draw(st.integers(0, 9)) == 0:
        return [data[i:i + 1] for i in range(len(data))]
    cuts = sorted(set(draw(st.lists(st.integers(1, len(data) - 1), max_size=12))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
