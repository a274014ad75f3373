"""Certificates made at test time (``cryptography``): P-256 keys, self-signed or signed by a CA
made the same way, written as PEM files."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tandem.services.serving.config import AppConfig


@dataclass(frozen=True)
class Credentials:
    cert_file: str
    key_file: str

    @property
    def cert(self) -> bytes:
        return Path(self.cert_file).read_bytes()

    def config(self, **settings: object) -> AppConfig:
        return AppConfig(tls_cert_file=self.cert_file, tls_key_file=self.key_file,
                         **settings)  # type: ignore[arg-type]


def issue(directory: Path, name: str, subject: str, sans: list[x509.GeneralName],
          issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
          ca: bool = False) -> tuple[Credentials, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A P-256 key and its certificate (self-signed without ``issuer``), as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(subject_name)
               .issuer_name(issuer_cert.subject if issuer_cert else subject_name)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Credentials(str(cert_file), str(key_file)), cert, key
