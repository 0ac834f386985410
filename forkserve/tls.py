"""TLS: the server's ``ssl.SSLContext``, built from the settings by the arbiter.

Owns: reading the certificate chain and key (as root, before any worker drops privileges:
the arbiter builds the context and the workers inherit it at fork), the key's password (from
a file, never the command line where ``ps`` shows it), client certificates (``--ca-certs``,
``--cert-reqs``), ``--ciphers``, TLS 1.2 at least, ALPN ``http/1.1``. A HUP builds it anew
(certificate rotation without a restart); a new one that does not load keeps the old, with
an error line (see forkserve.arbiter.rollout).

The handshake itself runs in the worker, bounded by the header timeout (see
forkserve.workers.connection).

Imports only the standard library.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass, field
from typing import Any

CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


class TLSError(Exception):
    """The certificate, key or options do not make a context: one line, for the operator."""


@dataclass(frozen=True)
class TLSMaterial:
    """What the arbiter read (as root) to build a context: a context can be built again from
    it after fork without reading any file (the gevent worker does, once gevent has patched
    ssl: a context made before that cannot wrap its sockets). The files may have changed
    since (a rotation, or a bad one a HUP refused): this is what was accepted."""

    chain: bytes
    key: bytes
    password: str | None = field(repr=False)
    ca: str | None
    cert_reqs: str
    ciphers: str | None


def read_material(values: dict[str, Any]) -> TLSMaterial:
    """From the resolved settings (``Config.values``)."""
    certfile, keyfile = values["certfile"], values["keyfile"] or values["certfile"]
    password = values.get("keyfile_password")  # (FORKSERVE_KEYFILE_PASSWORD, or the file)
    if values["keyfile_password_file"]:
        password = _read(values["keyfile_password_file"], "--keyfile-password-file").decode(
            "utf-8").rstrip("\r\n")
    ca = _read(values["ca_certs"], "--ca-certs").decode("ascii", "replace") \
        if values["ca_certs"] else None
    if values["cert_reqs"] != "none" and ca is None:
        raise TLSError(f"--cert-reqs {values['cert_reqs']} needs --ca-certs (whom to trust)")
    return TLSMaterial(_read(certfile, "--certfile"), _read(keyfile, "--keyfile"), password, ca,
                       values["cert_reqs"], values["ciphers"])


def build_context(values: dict[str, Any]) -> tuple[ssl.SSLContext, TLSMaterial]:
    material = read_material(values)
    return context_of(material), material


def context_of(material: TLSMaterial) -> ssl.SSLContext:
    """A server context from ``material`` (``ssl`` as it is now: gevent's once patched)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    # load_cert_chain reads paths only: the bytes go through a private file (0600, in a
    # directory of our own) that exists for this call alone.
    with tempfile.TemporaryDirectory(prefix="forkserve-tls-") as directory:
        chain, key = os.path.join(directory, "chain.pem"), os.path.join(directory, "key.pem")
        for path, data in ((chain, material.chain), (key, material.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        try:
            context.load_cert_chain(chain, key, material.password)
        except ssl.SSLError as exc:
            raise TLSError(f"the certificate and key: {_reason(exc)}") from None
    if material.ciphers:
        try:
            context.set_ciphers(material.ciphers)
        except ssl.SSLError:
            raise TLSError(f"--ciphers {material.ciphers!r}: no cipher matches") from None
    context.verify_mode = CERT_REQS[material.cert_reqs]
    if material.ca is not None:
        try:
            context.load_verify_locations(cadata=material.ca)
        except ssl.SSLError as exc:
            raise TLSError(f"--ca-certs: {_reason(exc)}") from None
    context.set_alpn_protocols(["http/1.1"])
    return context


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise TLSError(f"{what}: cannot read {path}: no such file") from None
    except OSError as exc:
        raise TLSError(f"{what}: cannot read {path}: {(exc.strerror or str(exc)).lower()}") from None


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or ("PEM_LIB" if "PEM lib" in str(exc) else None)
    if reason == "KEY_VALUES_MISMATCH":
        return "the key does not match the certificate"
    if reason in ("PEM_LIB", "NO_START_LINE", "BAD_BASE64_DECODE", "NO_CERTIFICATE_OR_CRL_FOUND"):
        return "not a PEM certificate or key (or a wrong password)"
    return str(reason or exc)
