"""The server's TLS context (forkserve.tls), built from settings and from the material read
(the gevent worker rebuilds it after fork from memory, never from the files again)."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
import trustme

from forkserve.tls import TLSError, build_context, context_of


def values(**over: Any) -> dict[str, Any]:
    base = {"certfile": None, "keyfile": None, "keyfile_password_file": None, "ca_certs": None,
            "cert_reqs": "none", "ciphers": None}
    return {**base, **over}


@pytest.fixture
def pem(tmp_path: Path) -> Path:
    path = tmp_path / "server.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(path))
    return path


def test_the_floor_alpn_and_no_client_certificates(pem: Path) -> None:
    context, material = build_context(values(certfile=str(pem)))
    assert context.minimum_version is ssl.TLSVersion.TLSv1_2
    assert context.verify_mode == ssl.CERT_NONE
    assert context.options & ssl.OP_NO_COMPRESSION
    assert material.chain == material.key == pem.read_bytes()


def test_built_again_from_memory_after_the_files_changed(pem: Path) -> None:
    """A HUP that refused a bad new file keeps what was read; a rebuild must not re-read."""
    _, material = build_context(values(certfile=str(pem)))
    pem.write_text("garbage\n")
    with pytest.raises(TLSError):
        build_context(values(certfile=str(pem)))
    assert isinstance(context_of(material), ssl.SSLContext)


def test_an_encrypted_key_with_its_password_file(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    cert = trustme.CA().issue_cert("127.0.0.1")
    key = serialization.load_pem_private_key(cert.private_key_pem.bytes(), None)
    encrypted = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.BestAvailableEncryption(b"s3cret"))
    (tmp_path / "key.pem").write_bytes(encrypted)
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    (tmp_path / "password").write_text("s3cret\n")
    args = values(certfile=str(tmp_path / "cert.pem"), keyfile=str(tmp_path / "key.pem"))
    assert build_context({**args, "keyfile_password_file": str(tmp_path / "password")})
    # Or from the environment (FORKSERVE_KEYFILE_PASSWORD: a setting with no flag).
    from forkserve.config import ConfigError, parse_args, resolve
    config = resolve(parse_args(["--certfile", args["certfile"], "--keyfile", args["keyfile"],
                                 "tests.apps.basic:app"], "test")[0],
                     {"FORKSERVE_KEYFILE_PASSWORD": "s3cret"})
    assert build_context(config.values)
    with pytest.raises(ConfigError):  # no such flag (and no abbreviation of another one)
        parse_args(["--keyfile-password", "s3cret", "tests.apps.basic:app"], "test")
    (tmp_path / "password").write_text("wrong\n")
    with pytest.raises(TLSError):
        build_context({**args, "keyfile_password_file": str(tmp_path / "password")})


def test_proxy_protocol_with_tls_is_refused_not_broken(pem: Path) -> None:
    """The PROXY header precedes the TLS handshake on the wire, and the workers read it from
    the decrypted stream: together they would fail every handshake, so they are refused."""
    from forkserve.config import ConfigError, parse_args, resolve
    with pytest.raises(ConfigError, match="--proxy-protocol cannot be used with --certfile"):
        resolve(parse_args(["--proxy-protocol", "--certfile", str(pem), "tests.apps.basic:app"],
                           "test")[0], {})


def test_client_certificates_need_a_ca(pem: Path, tmp_path: Path) -> None:
    with pytest.raises(TLSError, match="needs --ca-certs"):
        build_context(values(certfile=str(pem), cert_reqs="optional"))
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    context, _ = build_context(values(certfile=str(pem), cert_reqs="required",
                                      ca_certs=str(tmp_path / "ca.pem")))
    assert context.verify_mode == ssl.CERT_REQUIRED
