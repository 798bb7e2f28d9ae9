"""A throwaway CA and one server certificate for the nodes' daemons (their IP addresses as SANs),
so Prometheus reaches each daemon's /sd over TLS with basic auth as it would across hosts."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

import bcrypt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

USER, PASSWORD = "prometheus", "multinode-pass"


def _cert(
    subject: str, key, issuer: str, issuer_key, *, ca: bool, ips: list[str]
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ips:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(i)) for i in ips]),
            critical=False,
        )
    return b.sign(issuer_key, hashes.SHA256())


def write_web_config(d: Path, ips: list[str]) -> tuple[Path, Path]:
    """(web config for the daemons, CA file for Prometheus) under ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("multinode CA", ca_key, "multinode CA", ca_key, ca=True, ips=[])
    cert = _cert("ddpmon daemon", key, "multinode CA", ca_key, ca=False, ips=ips)
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "daemon.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "daemon.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    web = d / "web.yml"
    web.write_text(
        "tls_server_config:\n  cert_file: daemon.crt\n  key_file: daemon.key\n"
        f"basic_auth_users:\n  {USER}: '{hashed}'\n"
    )
    return web, d / "ca.crt"
