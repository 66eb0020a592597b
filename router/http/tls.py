"""The HTTP port's TLS: the public gRPC port's certificate (RouterConfig.public_tls), client
certificates required when it names a CA, and files re-read when they change, as the gRPC port
does: each handshake looks at them first (an SNI callback, called with or without a name)."""

import ssl

from tandem.security.tls import TlsConfig, TlsFiles


def _context(tls: TlsConfig) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert, tls.key)
    if tls.ca is not None:
        context.load_verify_locations(cafile=tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class RotatingContext:
    """`context` serves the files of `tls`; after they change, the next handshake gets a context
    of the new ones (a half-written rotation is skipped until it reads whole: TlsFiles)."""

    def __init__(self, tls: TlsConfig):
        self._files = TlsFiles(tls)  # checks that the key is the certificate's
        self._current = _context(tls)
        self.context = _context(tls)
        self.context.sni_callback = self._handshake

    def _handshake(self, ssl_object: ssl.SSLObject, server_name: str | None, _context_) -> None:
        if self._files.refresh() is not None:
            self._current = _context(self._files.config)
        ssl_object.context = self._current


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """None: plaintext (no certificate; TLS may end at a load balancer in front)."""
    return RotatingContext(tls).context if tls.serves_tls else None
