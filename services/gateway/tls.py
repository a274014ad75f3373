"""TLS for the front ends: the certificate chain and private key (PEM files; on Kubernetes a
Secret mounted into the gateway's pod) that HTTPS and gRPC serve with."""

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
        """Both files read and checked now (a certificate chain and its own key), so that a bad
        one fails the gateway at start with the setting's name, not later inside ssl."""
        cert_chain = _read("tls_cert_file", cert_file)
        private_key = _read("tls_key_file", key_file)
        try:  # never prompts: an encrypted key gets the empty password and fails here
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file,
                                                                    password=lambda: b"")
        except ssl.SSLError as exc:
            raise TLSConfigError(
                f"tls_cert_file {cert_file} and tls_key_file {key_file} are not a PEM "
                f"certificate chain and its unencrypted private key ({exc.reason or exc})"
            ) from None
        return cls(cert_file, key_file, cert_chain, private_key)


def _read(setting: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"cannot read {setting} {path}: {exc.strerror}") from None
