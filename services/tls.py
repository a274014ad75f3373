"""TLS: the front ends' certificate (``ServerTLS``: HTTPS and gRPC, the gateway) and the
workers' mutual TLS for KV bytes between them (``InternalTLS``: the TCP transport). PEM files;
on Kubernetes Secrets mounted into the pods. Every file is read and checked when the setting is
read, so a bad one fails at start with the setting's name, not later inside ssl."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path


class TLSConfigError(ValueError):
    """A TLS file that cannot be read or used; the message names the setting."""


@dataclass(frozen=True)
class ServerTLS:
    cert_file: str
    key_file: str
    cert_chain: bytes  # PEM: the server's certificate, then any intermediates
    private_key: bytes = field(repr=False)  # PEM, unencrypted

    @classmethod
    def read(cls, cert_file: str, key_file: str) -> ServerTLS:
        """Both files read and checked now (a certificate chain and its own key)."""
        cert_chain = _read("tls_cert_file", cert_file)
        private_key = _read("tls_key_file", key_file)
        _load_chain(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), ("tls_cert_file", cert_file),
                    ("tls_key_file", key_file))
        return cls(cert_file, key_file, cert_chain, private_key)


@dataclass(frozen=True)
class InternalTLS:
    """Mutual TLS between workers: each holds a certificate and key that the cluster's CA
    signed, and talks only to peers whose certificate that CA signed (both sides check).
    Workers reach each other by pod IP, so names are not checked: a peer is whoever the CA
    vouches for, and the cluster handshake (services/protocol/handoff.py) then proves which
    worker it is."""

    cert_file: str
    key_file: str
    ca_file: str

    SETTINGS = ("internal_tls_cert_file", "internal_tls_key_file", "internal_tls_ca_file")

    @classmethod
    def read(cls, cert_file: str, key_file: str, ca_file: str) -> InternalTLS:
        tls = cls(cert_file, key_file, ca_file)
        tls.server_context()  # reads and checks all three files
        return tls

    def server_context(self) -> ssl.SSLContext:
        return self._context(ssl.PROTOCOL_TLS_SERVER)

    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.PROTOCOL_TLS_CLIENT)

    def _context(self, protocol: int) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED  # the server asks for the client's, too
        cert, key, ca = zip(self.SETTINGS, (self.cert_file, self.key_file, self.ca_file),
                            strict=True)
        for setting, path in (cert, key, ca):
            _read(setting, path)
        _load_chain(context, cert, key)
        try:
            context.load_verify_locations(cafile=self.ca_file)
        except ssl.SSLError as exc:
            raise TLSConfigError(f"{ca[0]} {ca[1]} is not a PEM CA certificate "
                                 f"({exc.reason or exc})") from None
        return context


def _load_chain(context: ssl.SSLContext, cert: tuple[str, str], key: tuple[str, str]) -> None:
    try:  # never prompts: an encrypted key gets the empty password and fails here
        context.load_cert_chain(cert[1], key[1], password=lambda: b"")
    except ssl.SSLError as exc:
        raise TLSConfigError(
            f"{cert[0]} {cert[1]} and {key[0]} {key[1]} are not a PEM certificate chain and its "
            f"unencrypted private key ({exc.reason or exc})") from None


def _read(setting: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"cannot read {setting} {path}: {exc.strerror}") from None
