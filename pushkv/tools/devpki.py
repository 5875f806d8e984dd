"""A throw-away PKI for development and tests: one CA and a certificate per identity.

`pushkv dev-certs DIR --engine prefill-0 --engine decode-0` writes ca.pem, and
<name>.pem / <name>.key for the coordinator, the router, each engine and an
operator. Production deployments use their own CA; the identities (certificate
common names) are described in controlplane/auth.py and docs/security.md.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = path.with_suffix(".key")
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)


def make_pki(
    out: Path,
    *,
    engines: Sequence[str] = (),
    operators: Sequence[str] = ("ops",),
    hosts: Sequence[str] = ("localhost", "127.0.0.1"),
    days: int = 30,
) -> dict[str, Path]:
    """Create the CA and certificates; returns identity -> certificate path (".pem")."""
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("pushkv dev CA"))
        .issuer_name(_name("pushkv dev CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write(out / "ca", ca_key, ca)
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    identities = {"coordinator": "coordinator", "router": "router"}
    identities |= {f"engine-{e}": f"engine:{e}" for e in engines}
    identities |= {f"operator-{o}": f"operator:{o}" for o in operators}
    paths: dict[str, Path] = {}
    for file_name, cn in identities.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write(out / file_name, key, cert)
        paths[cn] = out / f"{file_name}.pem"
    return paths
