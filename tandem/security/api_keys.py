"""API keys on the router's public API: `authorization: Bearer <key>` metadata, checked against a
file of keys (one a line; blank lines and `#` comments skipped) that is read again when it
changes, so keys are added and revoked without a restart.

Keys never leave this module: logs, traces and metrics name a key by key_id(), the first 12 hex
digits of its SHA-256. Comparison is constant-time against every key, so the time a refusal takes
says nothing about how much of a key was right."""

import hashlib
import hmac
import logging
import threading
from pathlib import Path

import grpc

from tandem.errors import InvalidArgument
from tandem.security.guard import OPEN_SERVICES, Refusal, service_of

log = logging.getLogger(__name__)

_SCHEME = "bearer "


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_keys(text: str) -> tuple[bytes, ...]:
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line.encode())
    return tuple(keys)


def bearer_key(metadata) -> str | None:
    """The key of an `authorization: Bearer <key>` entry, None if there is none."""
    for name, value in metadata or ():
        if name == "authorization" and isinstance(value, str) and value[:len(_SCHEME)].lower() == _SCHEME:
            return value[len(_SCHEME):].strip()
    return None


class ApiKeys:
    """The keys of one file; a check refuses a call without a valid key as UNAUTHENTICATED."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp = None
        self._keys: tuple[bytes, ...] = ()
        self._reload()
        if not self._keys:
            raise InvalidArgument(f"--api-key-file {self.path}: no keys in it (one a line)")

    def _reload(self) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            keys = parse_keys(self.path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            if self._stamp is None:
                raise InvalidArgument(f"--api-key-file {self.path}: {e}") from e
            log.warning("API key file %s unreadable (%s); keeping the %d keys in use", self.path, e, len(self._keys))
            return
        if self._stamp is not None:
            if keys:
                log.info("API keys re-read from %s: %d keys", self.path, len(keys))
            else:
                log.warning("API key file %s holds no key now: every call is refused", self.path)
        self._stamp, self._keys = stamp, keys

    def valid(self, key: str) -> bool:
        with self._lock:
            self._reload()
            keys = self._keys
        given = key.encode()
        found = False
        for known in keys:  # every key compared, whatever matched: constant time in the match
            found |= hmac.compare_digest(given, known)
        return found

    def __call__(self, method: str, context) -> Refusal | None:
        if service_of(method) in OPEN_SERVICES:
            return None
        key = bearer_key(context.invocation_metadata())
        if key is None:
            return Refusal(grpc.StatusCode.UNAUTHENTICATED, "missing API key: send metadata 'authorization: Bearer <key>'")
        if not self.valid(key):
            log.info("refused %s: unknown API key %s", method, key_id(key))
            return Refusal(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        return None
