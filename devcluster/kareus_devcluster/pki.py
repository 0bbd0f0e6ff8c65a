"""The dev cluster's certificates: one CA, serving certificates, client certificates, the SA key.

As kubeadm lays it out, at a smaller scale: every component authenticates to the API server with
an x509 client certificate whose CN is its user and whose O entries are its groups
(`system:kube-controller-manager`, `system:kube-scheduler`, `system:node:<name>` in
`system:nodes`, the admin in `system:masters`); the API server serves with a certificate for
127.0.0.1 and the `kubernetes.default.svc` names; service-account tokens are signed with an RSA
key the API server verifies and the controller manager uses for legacy token secrets.
EC P-256 keys for certificates (fast to make), RSA for service accounts (RS256, what every
client library verifies).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=30)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key on disk (PEM)."""

    cert_file: Path
    key_file: Path


class Authority:
    """A CA that lives in one directory and issues certificates into it."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kareus-dev-ca")])
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self._key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256()))
        self.cert_file = self.directory / "ca.crt"
        self.cert_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, common_name: str, *, groups: tuple[str, ...] = (), server: bool = False,
              client: bool = False, ips: tuple[str, ...] = (), dns: tuple[str, ...] = ()) -> KeyPair:
        """Write `<name>.crt`/`<name>.key`: CN = user, O = groups, SANs for servers."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([*(x509.NameAttribute(NameOID.ORGANIZATION_NAME, group) for group in groups),
                             x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        usages = [*([ExtendedKeyUsageOID.SERVER_AUTH] if server else []),
                  *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])]
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(self._cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if ips or dns:
            names = [*(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips), *(x509.DNSName(d) for d in dns)]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = KeyPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(pair.key_file, key)
        return pair


def service_account_keys(directory: Path) -> KeyPair:
    """The RSA key pair service-account tokens are signed with (`sa.pub` holds the public half)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pair = KeyPair(Path(directory) / "sa.pub", Path(directory) / "sa.key")
    pair.cert_file.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                             serialization.PublicFormat.SubjectPublicKeyInfo))
    _write_key(pair.key_file, key)
    return pair


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
