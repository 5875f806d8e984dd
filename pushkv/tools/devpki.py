"""A throw-away PKI for development and tests: one CA and a certificate per identity.

`pushkv dev-certs DIR --engine prefill-0 --engine decode-0` writes ca.pem, and
<name>.pem / <name>.key for the coordinator, the router, each engine and an
operator. Production deployments use their own CA; the identities (certificate
common names) are described in controlplane/auth.py and docs/security.md.
`--ca-from OLD` issues them from OLD's CA instead of a new one: a renewal, as
cert-manager renews a certificate (a new key and serial, the same CA).
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


def _load_ca(folder: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    cert_path, key_path = folder / "ca.pem", folder / "ca.key"
    for p in (cert_path, key_path):
        if not p.is_file():
            raise ValueError(f"--ca-from {folder}: no {p.name} there (written by dev-certs)")
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"--ca-from {folder}: ca.key is not an EC key (written by dev-certs)")
    return key, x509.load_pem_x509_certificate(cert_path.read_bytes())


def make_pki(
    out: Path,
    *,
    engines: Sequence[str] = (),
    operators: Sequence[str] = ("ops",),
    hosts: Sequence[str] = ("localhost", "127.0.0.1"),
    days: int = 30,
    ca_from: Path | None = None,
) -> dict[str, Path]:
    """Create the CA (or take `ca_from`'s: ca.pem and ca.key there) and the
    certificates; returns identity -> certificate path (".pem")."""
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    if ca_from is not None:
        ca_key, ca = _load_ca(ca_from)
    else:
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
