"""`tandem certs create DIR`: a development certificate authority and one certificate per
identity (router, target, draft, client), for mutual TLS between the services.

Each certificate names its identity as its common name and first DNS SAN (what the services
authorize by), plus the hosts a client may dial it by (localhost, 127.0.0.1, ::1 and any
given). Production deployments bring certificates from their own CA (cert-manager, Vault):
the services only need the PEM files."""

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tandem.errors import InvalidArgument

IDENTITIES = ("router", "target", "draft", "client")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 365


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tandem development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # in order, once each
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _builder(subject: x509.Name, issuer: x509.Name, key, now: datetime.datetime, days: int) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little apart
            .not_valid_after(now + datetime.timedelta(days=days)))


def make_ca(days: int = VALID_DAYS) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("tandem development CA")
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (_builder(name, name, key, now, days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def make_leaf(identity: str, hosts: list[str], ca: x509.Certificate, ca_key, days: int = VALID_DAYS):
    """A certificate for `identity`, usable both to serve and as a client (a service does both)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (_builder(_name(identity), ca.subject, key, now, days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san([identity, *hosts]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    # Written whole under another name, then renamed: a service re-reading its files mid-write
    # (rotation) never sees half a key. A key is created 0600 from the first byte, never through a
    # link someone planted at the temporary name.
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _load_or_make_ca(out: Path, days: int, reuse_ca: bool):
    ca_path, ca_key_path = out / "ca.pem", out / "ca-key.pem"
    if ca_path.exists() and not ca_key_path.exists():
        raise InvalidArgument(f"{out} holds a CA (ca.pem) without its key (ca-key.pem): not replaced; issue"
                              " certificates from that CA with its own tools, or use another folder")
    if reuse_ca and ca_path.exists():
        ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
        return ca, serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    ca, ca_key = make_ca(days)
    _write(ca_key_path, _key_pem(ca_key), private=True)
    _write(ca_path, _pem(ca))
    return ca, ca_key


def _check_hosts(hosts, identities) -> None:
    """A host named like an identity would make every certificate that identity (the services
    authorize by DNS names): `--host router` on the draft's certificate lets it reset the target."""
    clash = sorted(set(hosts) & {*IDENTITIES, *identities})
    if clash:
        raise InvalidArgument(f"--host {', '.join(clash)}: an identity's name, not a host name (each certificate"
                              " already names its own identity)")


def create_dir(out: Path, hosts: list[str] = (), identities: tuple[str, ...] = IDENTITIES, days: int = VALID_DAYS,
               reuse_ca: bool = True, split: bool = False) -> list[Path]:
    """Writes ca.pem (+ ca-key.pem) and {identity}.pem / {identity}-key.pem for each identity;
    an existing CA in `out` is reused (re-issuing leaves (rotation) keeps peers' trust). The
    services' certificates also name `hosts` (and the local ones); the client's names only
    itself. split: each identity's pair and ca.pem in a folder of its own, out/{identity}/, so
    that each service can be given its own files and nothing else (not the CA's key)."""
    _check_hosts(hosts, identities)
    out.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _load_or_make_ca(out, days, reuse_ca)
    written = [out / "ca.pem"]
    for identity in identities:
        folder = out / identity if split else out
        folder.mkdir(exist_ok=True)
        if split:
            _write(folder / "ca.pem", _pem(ca))
        names = [] if identity == "client" else [*LOCAL_HOSTS, *hosts]
        cert, key = make_leaf(identity, names, ca, ca_key, days)
        _write(folder / f"{identity}-key.pem", _key_pem(key), private=True)
        _write(folder / f"{identity}.pem", _pem(cert))
        written.append(folder / f"{identity}.pem")
    return written
