"""The router's link to the target service: its channel, the step stream, and the target's
lifecycle as the router sees it (reachable or not, restarted or not, reset). Every gRPC call of
the router to the target is made here; the engine loop sees domain types and typed errors
(Unavailable when the target is gone) and decides what they mean for requests."""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from router.call_stream import CallStream
from tandem import codec
from tandem.channels import RenewableChannel
from tandem.errors import Unavailable
from tandem.grpc_server import MAX_RECONNECT_BACKOFF_MS
from tandem.ops import EngineInfo, StepRequest
from tandem.security.tls import PLAINTEXT, TlsConfig
from tandem.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)
RESET_RETRY_S = 1.0
# A lost target is asked this long for its info, waiting for the channel to reconnect: a target
# back within the reconnect backoff is found, not its waiting requests failed.
RESET_WAIT_S = MAX_RECONNECT_BACKOFF_MS / 1e3 + RESET_RETRY_S


@dataclass(frozen=True, slots=True)
class Reset:
    """A target that dropped every sequence: its last step id (the draft waits for hidden
    states by the target's step ids), its info, and whether it is another process than before."""

    last_step_id: int
    info: EngineInfo
    restarted: bool


class TargetLink:
    def __init__(self, channel: RenewableChannel, info: EngineInfo, step_timeout_s: float,
                 on_stream_end: Callable[[], None] | None = None):
        self._channel = channel
        self._stub = engine_pb2_grpc.TargetEngineStub(channel.channel)
        self.step_timeout_s = step_timeout_s
        self.instance_id = info.instance_id  # a restarted target is another
        # A stream that ends while idle wakes the loop (on_stream_end): a target gone or
        # restarted is found then, not at the next request.
        self._steps = CallStream(lambda: self._stub.Steps(), step_timeout_s, "target service", "step_id", on_stream_end)

    @property
    def channel(self):
        return self._channel.channel

    @classmethod
    async def connect(cls, address: str, tls: TlsConfig = PLAINTEXT, timeout_s: float = 120.0,
                      step_timeout_s: float = 120.0,
                      on_stream_end: Callable[[], None] | None = None) -> tuple["TargetLink", Reset]:
        """Waits for the target (it may still be loading weights) and resets it: a router that
        starts fresh owns no sequences, so whatever a previous one left goes."""
        channel = RenewableChannel(address, tls)
        stub = engine_pb2_grpc.TargetEngineStub(channel.channel)
        try:
            info = codec.info_from_pb(await stub.Info(engine_pb2.InfoRequest(), wait_for_ready=True, timeout=timeout_s))
            stats = await stub.Reset(engine_pb2.ResetRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            await channel.close()
            raise RuntimeError(f"router: target at {address} not reachable: {e.code().name}: {e.details()}") from e
        return cls(channel, info, step_timeout_s, on_stream_end), Reset(stats.last_step_id, info, restarted=False)

    @property
    def stream_open(self) -> bool:
        return self._steps.is_open

    def open_stream(self) -> None:
        self._steps.open()

    async def step(self, request: StepRequest, trace_metadata=()):
        """Runs one step on the stream; a failed step raises its TandemError (Unavailable when
        the target went away or stalled)."""
        message = codec.step_request_to_pb(request)
        message.trace_context.update(trace_metadata or ())
        return codec.step_result_from_pb(await self._steps.call(message))

    async def check(self) -> None:
        """Raises Unavailable if the target is unreachable or is another process than the one the
        router's view of sequences is of."""
        try:
            info = await self._stub.Info(engine_pb2.InfoRequest(), timeout=self.step_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise Unavailable(f"target service unavailable: {e.details()}") from e
        if info.instance_id != self.instance_id:
            raise Unavailable("target service restarted")

    async def reset(self) -> Reset:
        """Drops every sequence on the target; raises Unavailable if it cannot be reached. A
        changed certificate or CA on disk is taken first (a new channel)."""
        if await self._channel.renew():
            self._steps.close()
            self._stub = engine_pb2_grpc.TargetEngineStub(self._channel.channel)
        try:
            # Reachable first: Info takes no lock and rides out the channel's reconnect backoff;
            # the reset then waits for a step the target may still be running.
            await self._stub.Info(engine_pb2.InfoRequest(), wait_for_ready=True, timeout=RESET_WAIT_S)
            stats = await self._stub.Reset(engine_pb2.ResetRequest(), timeout=self.step_timeout_s)
            info = codec.info_from_pb(await self._stub.Info(engine_pb2.InfoRequest(), timeout=self.step_timeout_s))
        except grpc.aio.AioRpcError as e:
            raise Unavailable(f"target service unavailable: {e.details()}") from e
        restarted = info.instance_id != self.instance_id
        if restarted:
            log.warning("target service restarted (instance %s, was %s)", info.instance_id, self.instance_id)
            self.instance_id = info.instance_id
        return Reset(stats.last_step_id, info, restarted)

    async def close(self) -> None:
        self._steps.close()
        await self._channel.close()
