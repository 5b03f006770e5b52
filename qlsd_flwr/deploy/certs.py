"""Certificates and keys for a secured deployment: a CA and a SuperLink certificate, SuperNode
authentication key pairs."""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
from pathlib import Path

__all__ = ["make_tls_certificates", "make_node_keypair", "KeyFileError"]


class KeyFileError(ValueError):
    """A key or certificate cannot be written as asked (it exists, a bad argument); one line."""


def _write_new(path: Path, data: bytes, private: bool, force: bool) -> None:
    """Write ``data`` to a new file: a private key is created with mode 0600 from its first byte
    (never readable by others, not even for a moment); an existing file is kept unless ``force``."""
    if path.exists() and not force:
        raise KeyFileError(f"{path} exists; keep it, or pass --force to replace it")
    if force and path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# ---- certificates and keys ------------------------------------------------------------------
def make_tls_certificates(out_dir: str | os.PathLike, hosts=("127.0.0.1", "localhost"),
                          days: int = 365, force: bool = False) -> dict[str, Path]:
    """A self-signed CA and a SuperLink server certificate signed by it.

    Writes ``ca.crt``, ``ca.key``, ``server.pem`` and ``server.key`` (PEM) to ``out_dir`` and
    returns their paths. ``hosts`` are the SuperLink's addresses as the SuperNodes and the
    CLI reach it (IPs and DNS names, all put in the certificate's subjectAltName). ``days``: the
    validity, at least 1. Existing files are kept (:class:`KeyFileError`) unless ``force``.
    """
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise KeyFileError(f"--days must be an integer >= 1 (got {days!r}): a certificate must be valid now")
    hosts = tuple(str(h).strip() for h in hosts)
    if not hosts or any(not h or any(c.isspace() for c in h) for h in hosts):
        raise KeyFileError(f"--host must be a non-empty IP address or DNS name (got {list(hosts)!r})")
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
    if not force and (there := [str(p) for p in paths.values() if p.exists()]):
        raise KeyFileError(f"{', '.join(there)} exist(s); keep them, or pass --force to replace them")
    _write_new(paths["ca_key"], key_pem(ca_key), True, force)
    _write_new(paths["server_key"], key_pem(srv_key), True, force)
    _write_new(paths["ca_cert"], ca_cert.public_bytes(serialization.Encoding.PEM), False, force)
    _write_new(paths["server_cert"], srv_cert.public_bytes(serialization.Encoding.PEM), False, force)
    return paths


def make_node_keypair(out_dir: str | os.PathLike, name: str, force: bool = False) -> tuple[Path, Path]:
    """An EC P-384 key pair for SuperNode authentication: ``<name>`` (OpenSSH private key, for
    ``flower-supernode --auth-supernode-private-key``) and ``<name>.pub`` (OpenSSH public key,
    for ``flwr supernode register``). Same as ``ssh-keygen -t ecdsa -b 384 -N '' -f <name>``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    if not name or "/" in name or name in (".", ".."):
        raise KeyFileError(f"node-key: the name must be a file name (got {name!r})")
    priv, pub = out / name, out / f"{name}.pub"
    if not force and (there := [str(p) for p in (priv, pub) if p.exists()]):
        raise KeyFileError(f"{', '.join(there)} exist(s); keep them, or pass --force to replace them")
    _write_new(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()), True, force)
    _write_new(pub, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b"\n", False, force)
    return priv, pub
