"""A member's identity for one session: a fresh key pair and a self-signed certificate.

Nobody signs it: members learn each other's fingerprint (the SHA-256 of the DER certificate)
from the rendezvous and pin it, so a certificate authority would add nothing. A new identity
per session means a fingerprint links nothing across sessions.
"""

from __future__ import annotations

import datetime
import hashlib
import re
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


def fingerprint_of(certificate: x509.Certificate | bytes) -> str:
    """SHA-256 of the DER certificate, 64 lower-case hex digits (what the rendezvous carries)."""
    der = certificate if isinstance(certificate, bytes) else certificate.public_bytes(Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def normalize_fingerprint(fingerprint: str) -> str:
    """Lower case, and exactly 64 hex digits: a typo must fail loudly, not pin nothing."""
    value = fingerprint.strip().lower()
    if not FINGERPRINT.match(value):
        raise ValueError("a fingerprint is the SHA-256 of a certificate: 64 hex digits")
    return value


@dataclass(frozen=True)
class Identity:
    private_key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    fingerprint: str


def create_identity(name: str = "kafila member", valid_days: int = 30) -> Identity:
    """A fresh ECDSA P-256 key and a self-signed certificate for it.

    P-256 rather than Ed25519: both work with aioquic, P-256 is what every QUIC stack offers.
    Validity is not checked by peers (they pin), but a sane window keeps tools from complaining.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))  # tolerate skewed clocks
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        .sign(key, hashes.SHA256())
    )
    return Identity(key, certificate, fingerprint_of(certificate))
