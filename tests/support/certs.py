"""Real X.509 certificates for the TLS tests, made in the test with ``cryptography``:
a CA, a server certificate for 127.0.0.1/localhost, a client certificate the CA
signed, and a client certificate from another CA that must be refused."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, ca: bool, usage=None, sans=()):
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5))
         .not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, *objs) -> str:
    out = b""
    for o in objs:
        if isinstance(o, x509.Certificate):
            out += o.public_bytes(serialization.Encoding.PEM)
        else:
            out += o.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())
    path.write_bytes(out)
    return str(path)


@dataclass
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_cert: str  # a client certificate signed by another CA
    rogue_key: str

    def read(self, name: str) -> bytes:
        return Path(getattr(self, name)).read_bytes()


def make_certs(tmp: Path, server_cn: str = "phasewatch") -> Certs:
    tmp.mkdir(parents=True, exist_ok=True)
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert("phasewatch test CA", ca_key, "phasewatch test CA", ca_key, True)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, client_key, rogue_key = _key(), _key(), _key()
    server = _cert(server_cn, server_key, "phasewatch test CA", ca_key, False,
                   ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client = _cert("vllm-sidecar", client_key, "phasewatch test CA", ca_key, False,
                   ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue = _cert("intruder", rogue_key, "another CA", rogue_ca_key, False,
                  ExtendedKeyUsageOID.CLIENT_AUTH)
    return Certs(ca=_write(tmp / "ca.pem", ca),
                 server_cert=_write(tmp / "server.pem", server),
                 server_key=_write(tmp / "server-key.pem", server_key),
                 client_cert=_write(tmp / "client.pem", client),
                 client_key=_write(tmp / "client-key.pem", client_key),
                 rogue_cert=_write(tmp / "rogue.pem", rogue),
                 rogue_key=_write(tmp / "rogue-key.pem", rogue_key))
