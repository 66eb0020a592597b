"""TLS material of one service: its identity (certificate and key) and its trust bundle (CA),
re-read from disk when the files change, so certificates rotate without a restart.

Servers take new files at the next handshake (gRPC asks a fetcher before each one); outgoing
channels read the files when they are made: the draft makes a new peer channel whenever its
stream is lost, and the router a new channel to a service it resets after losing it
(tandem.channels.RenewableChannel), so both present new files from their next connection."""

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tandem.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """cert + key: this service's identity (it serves TLS); ca: the trust bundle (with it, the
    service's internal port requires client certificates signed by it, and its outgoing channels
    verify servers against it and present cert + key)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgument("--tls-cert and --tls-key go together (the certificate and its private key)")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise InvalidArgument(f"--tls-{name} {path}: no such file")

    @classmethod
    def of_identity(cls, folder: Path, name: str, trust: bool = True) -> "TlsConfig":
        """`name`'s pair in a `tandem certs create` folder ({name}.pem, {name}-key.pem), with its
        ca.pem unless `trust` is off."""
        folder = Path(folder)
        return cls(folder / f"{name}.pem", folder / f"{name}-key.pem", folder / "ca.pem" if trust else None)

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        """Both ends present certificates signed by `ca`."""
        return self.cert is not None and self.ca is not None

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None


PLAINTEXT = TlsConfig()


def _key_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    pem = serialization.Encoding.PEM
    return cert.public_key().public_bytes(pem, spki) == key.public_key().public_bytes(pem, spki)


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    """The bytes of one consistent read of the files (the key matches the certificate)."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None


class TlsFiles:
    """Reads a TlsConfig's files, and reads them again when any of them changed on disk. A read
    that finds a certificate and key that do not belong together (a rotation half written) is
    skipped: the last good material stays in use until the next look."""

    def __init__(self, config: TlsConfig):
        self.config = config
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._material = self._read()
        if self._material is None:
            raise InvalidArgument(f"--tls-key {config.key} is not the private key of --tls-cert {config.cert}")

    def _paths(self) -> list[Path]:
        return [Path(p) for p in (self.config.cert, self.config.key, self.config.ca) if p is not None]

    def _stat(self) -> tuple:
        stamps = []
        for path in self._paths():
            try:
                st = path.stat()
                stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def _read(self) -> TlsMaterial | None:
        c = self.config
        try:
            cert = Path(c.cert).read_bytes() if c.cert else None
            key = Path(c.key).read_bytes() if c.key else None
            ca = Path(c.ca).read_bytes() if c.ca else None
            if cert is not None and not _key_matches(cert, key):
                return None
        except (OSError, ValueError) as e:
            log.warning("TLS files unreadable (%s); keeping the ones in use", e)
            return None
        return TlsMaterial(cert, key, ca)

    @property
    def material(self) -> TlsMaterial:
        return self._material

    def refresh(self) -> TlsMaterial | None:
        """The new material if the files changed (and read consistently) since the last look,
        else None."""
        with self._lock:
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            material = self._read()
            if material is None:
                return None  # looked at again at the next call: the stamp is not taken
            self._stamp, self._material = stamp, material
            log.info("TLS: certificates re-read from %s", ", ".join(str(p) for p in self._paths()))
            return material
