"""Every gRPC channel and server of tandem is made here: credentials (plaintext, TLS, mutual
TLS), keepalive, message limits and reconnect backoff are set once, for the router's channels to
the target and the draft, the draft's peer stream to the target, the CLI's clients, the benches,
and the three services' servers."""

import ipaddress
import json
import logging
from collections.abc import Sequence
from concurrent import futures

import grpc

from tandem.grpc_server import (CHANNEL_OPTIONS, PUBLIC_SERVER_OPTIONS, SERVER_OPTIONS, AioErrorInterceptor,
                                ErrorInterceptor)
from tandem.security.guard import AioGuardInterceptor, Check, GuardInterceptor
from tandem.security.tls import PLAINTEXT, TlsConfig, TlsFiles, TlsMaterial

log = logging.getLogger(__name__)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials | None:
    """None for plaintext. The files are read now: a channel made after a rotation uses the new
    ones. With a CA the server is verified against it (else against the system's roots); with a
    certificate and key the channel presents them (mutual TLS)."""
    if not tls.enabled:
        return None
    material = TlsFiles(tls).material
    return grpc.ssl_channel_credentials(root_certificates=material.ca, private_key=material.key,
                                        certificate_chain=material.cert)


# The public API's clients (tandem generate) retry a call the router refused for load, waiting the
# grpc-retry-pushback-ms it sends (gRPC's A6: its own backoff otherwise; a negative pushback, as
# for a request that can never fit, stops retries), or while it is unreachable or draining (behind a
# load balancer the retry finds another replica). gRPC never retries a stream past its first
# response. The services' own channels never retry: their calls are steps of a state machine.
PUBLIC_RETRY_POLICY = json.dumps({"methodConfig": [{
    "name": [{"service": "tandem.v1.Generation"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "10s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]},
}]})


def open_channel(address: str, tls: TlsConfig = PLAINTEXT, *, aio: bool = False, options=CHANNEL_OPTIONS,
                 retry: bool = False):
    """A channel (grpc.aio's with aio) to `address` with tandem's options; `retry`: the public
    API's retry policy (PUBLIC_RETRY_POLICY)."""
    if retry:
        options = [*options, ("grpc.enable_retries", 1), ("grpc.service_config", PUBLIC_RETRY_POLICY)]
    api = grpc.aio if aio else grpc
    credentials = channel_credentials(tls)
    if credentials is None:
        return api.insecure_channel(address, options=options)
    return api.secure_channel(address, credentials, options=options)


class RenewableChannel:
    """An asyncio channel to one service whose TLS files are looked at again by renew(): if they
    changed (the client's own certificate rotated, or the CA), a new channel is made with them.
    The router renews when it resets a service after losing it: a connection made then presents
    the new identity (an established one keeps the one it was made with)."""

    def __init__(self, address: str, tls: TlsConfig = PLAINTEXT):
        self.address, self.tls = address, tls
        self._files = TlsFiles(tls) if tls.enabled else None
        self.channel = open_channel(address, tls, aio=True)

    async def renew(self) -> bool:
        """True if a new channel replaced the old one (the caller makes new stubs on it)."""
        if self._files is None or self._files.refresh() is None:
            return False
        old, self.channel = self.channel, open_channel(self.address, self.tls, aio=True)
        log.info("TLS files changed: a new channel to %s", self.address)
        await old.close()
        return True

    async def close(self) -> None:
        await self.channel.close()


def make_server(*, aio: bool = False, checks: Sequence[Check] = (), options=SERVER_OPTIONS, max_workers: int = 8,
                maximum_concurrent_rpcs: int | None = None):
    """A server whose calls pass the checks (identities, API keys) before anything else, then
    the interceptor that maps typed errors to status codes. `max_workers`: the sync server's
    threads (an aio server runs its calls on the event loop)."""
    if aio:
        interceptors = [*([AioGuardInterceptor(checks)] if checks else []), AioErrorInterceptor()]
        return grpc.aio.server(interceptors=interceptors, options=options, maximum_concurrent_rpcs=maximum_concurrent_rpcs)
    interceptors = [*([GuardInterceptor(checks)] if checks else []), ErrorInterceptor()]
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors, options=options,
                       maximum_concurrent_rpcs=maximum_concurrent_rpcs)


def public_server_options(max_connection_age_s: float, grace_s: float, min_ping_interval_s: float) -> list:
    """The router's public port: keepalive enforced (a client pinging more often than
    min_ping_interval_s is told to go away after two strikes), connections aged out (0: never)
    so clients reconnect and spread over replicas, their calls given `grace_s` to finish."""
    options = dict(PUBLIC_SERVER_OPTIONS)
    options["grpc.http2.min_ping_interval_without_data_ms"] = int(min_ping_interval_s * 1000)
    options["grpc.http2.max_ping_strikes"] = 2
    if max_connection_age_s:
        options["grpc.max_connection_age_ms"] = int(max_connection_age_s * 1000)
        options["grpc.max_connection_age_grace_ms"] = int(grace_s * 1000)
    return list(options.items())


def _server_config(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(material.key, material.cert)], root_certificates=material.ca)


def server_credentials(tls: TlsConfig, require_client_auth: bool) -> grpc.ServerCredentials:
    """Credentials that gRPC refreshes before each handshake: rotated files are served to new
    connections without a restart."""
    files = TlsFiles(tls)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        material = files.refresh()
        return None if material is None else _server_config(material)

    return grpc.dynamic_ssl_server_credentials(_server_config(files.material), fetch,
                                               require_client_authentication=require_client_auth)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(server, host: str, port: int, tls: TlsConfig, name: str, *, internal: bool = True) -> int:
    """Listens on host:port (TLS with tls's certificate; client certificates required when it
    has a CA); returns the bound port. `internal`: a port only the other services call, whose
    methods are authorized by the callers' certificates."""
    address = f"{host}:{port}"
    if tls.serves_tls:
        if internal and tls.ca is None and not is_loopback(host):
            log.warning("%s: TLS on %s without --tls-ca: any client that connects may call every method (mutual TLS"
                        " authorizes the router and the draft by their certificates)", name, address)
        bound = server.add_secure_port(address, server_credentials(tls, tls.ca is not None))
    else:
        if not is_loopback(host):
            log.warning("%s: listening on %s WITHOUT TLS: anyone who reaches this port can call it"
                        " (--tls-cert/--tls-key/--tls-ca, docs/deploy.md)", name, address)
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"{name}: cannot bind {address}")
    return bound
