"""Certificates and keys for a secured deployment: a CA and a SuperLink certificate, SuperNode
authentication key pairs."""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
from pathlib import Path

__all__ = ["make_tls_certificates", "make_node_keypair"]


# ---- certificates and keys ------------------------------------------------------------------
def make_tls_certificates(out_dir: str | os.PathLike, hosts=("127.0.0.1", "localhost"),
                          days: int = 365) -> dict[str, Path]:
    """A self-signed CA and a SuperLink server certificate signed by it.

    Writes ``ca.crt``, ``ca.key``, ``server.pem`` and ``server.key`` (PEM) to ``out_dir`` and
    returns their paths. ``hosts`` are the SuperLink's addresses as the SuperNodes and the
    CLI reach it (IPs and DNS names, all put in the certificate's subjectAltName).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=5)
    later = now + _dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qlsd-flwr test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(later)
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))

    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    srv_key = ec.generate_private_key(ec.SECP384R1())
    srv_cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0]))]))
                .issuer_name(ca_name).public_key(srv_key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(later)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))

    def key_pem(k):
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    paths = {"ca_cert": out / "ca.crt", "ca_key": out / "ca.key",
             "server_cert": out / "server.pem", "server_key": out / "server.key"}
    paths["ca_cert"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths["ca_key"].write_bytes(key_pem(ca_key))
    paths["server_cert"].write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    paths["server_key"].write_bytes(key_pem(srv_key))
    for p in ("ca_key", "server_key"):
        os.chmod(paths[p], 0o600)
    return paths


def make_node_keypair(out_dir: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """An EC P-384 key pair for SuperNode authentication: ``<name>`` (OpenSSH private key, for
    ``flower-supernode --auth-supernode-private-key``) and ``<name>.pub`` (OpenSSH public key,
    for ``flwr supernode register``). Same as ``ssh-keygen -t ecdsa -b 384 -N '' -f <name>``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    priv, pub = out / name, out / f"{name}.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    os.chmod(priv, 0o600)
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b"\n")
    return priv, pub
