"""Test certificates, generated fresh: a CA, a server certificate for 127.0.0.1/localhost,
a client certificate the CA signed, and a rogue CA with its own client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from conftest import require_module


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    """A client certificate from another CA: must be refused."""
    rogue_key: Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, key, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool, server: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    else:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    return builder.sign(issuer_key or key, hashes.SHA256()), name


def make_certs(directory: Path, server_name: str = "lossbeat-test") -> Certs:
    require_module("cryptography")
    ca_key = _key()
    ca_cert, ca_name = _cert("lossbeat test CA", ca_key, None, None, ca=True)
    _write(directory / "ca", ca_key, ca_cert)
    server_key = _key()
    _write(directory / "server", server_key, _cert(server_name, server_key, ca_name, ca_key, ca=False, server=True)[0])
    client_key = _key()
    _write(directory / "client", client_key, _cert("prometheus", client_key, ca_name, ca_key, ca=False)[0])
    rogue_ca_key = _key()
    _, rogue_name = _cert("rogue CA", rogue_ca_key, None, None, ca=True)
    rogue_key = _key()
    _write(directory / "rogue", rogue_key, _cert("prometheus", rogue_key, rogue_name, rogue_ca_key, ca=False)[0])
    return Certs(
        directory / "ca.crt",
        directory / "server.crt",
        directory / "server.key",
        directory / "client.crt",
        directory / "client.key",
        directory / "rogue.crt",
        directory / "rogue.key",
    )
