"""Certificates made in the test (the `cryptography` package): a CA, a server and a client."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def _issue(subject: str, key, ca_name: x509.Name, ca_key, *, is_ca: bool, usage=None, san=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    """A throwaway CA and, signed by it, a server certificate for localhost / 127.0.0.1 and a client one."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pagoda test CA")
    ca = _issue("pagoda test CA", ca_key, ca_name, ca_key, is_ca=True)
    paths = Pki(*(directory / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")))
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for role, cert_path, key_path in (("server", paths.server_cert, paths.server_key), ("client", paths.client_cert, paths.client_key)):
        key = ec.generate_private_key(ec.SECP256R1())
        if role == "server":
            san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            cert = _issue("localhost", key, ca_name, ca_key, is_ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH, san=san)
        else:
            cert = _issue("pagoda test client", key, ca_name, ca_key, is_ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
    return paths
