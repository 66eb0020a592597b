"""The router's calls to a model service (the target's steps, the draft's drafts) on one
bidirectional stream rather than a unary call each: a call's set-up (a new HTTP/2 stream,
headers, a deadline) costs about as much again as the message's round trip (a target step's
overhead here: 1.31 ms a call each, 0.86 ms on the stream; `tandem bench --mode rpc`)."""

import asyncio
from collections.abc import Callable

import grpc

from tandem.errors import TandemError, Unavailable

# A stream that broke (or a call that timed out) means the service went away or stalled.
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
_BROKEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


class CallStream:
    """One call in flight at a time (the router's loop awaits each). The stream opens on the
    first call and again after it breaks; a call that times out closes it, so a late answer
    can never be read as the next call's. Requests and responses carry an id (`id_field`)
    and, when the service failed that one, `error` (tandem.v1.StepError)."""

    def __init__(self, open_stream: Callable, timeout_s: float, service: str, id_field: str,
                 on_end: Callable[[], None] | None = None):
        self.open_stream = open_stream  # e.g. stub.Steps: a new stream-stream call
        self.on_end = on_end  # called when a stream ends, idle or not (the service went away)
        self.timeout_s = timeout_s
        self.service = service  # "target service": errors name it
        self.id_field = id_field
        self._call = None

    @property
    def is_open(self) -> bool:
        """A stream is open and has not ended (the next call will not open one)."""
        return self._call is not None and not self._call.done()

    def open(self) -> None:
        """Opens a stream unless one is open (call() does it too): the call starts at once, so
        its end, even before a request is written, reaches on_end."""
        if not self.is_open:
            self._call = self.open_stream()
            if self.on_end:
                self._call.add_done_callback(lambda _: self.on_end())

    async def call(self, request):
        """The response; raises Unavailable when the service is gone or too slow, a
        TandemError with the service's status when it failed this request."""
        self.open()  # first call, or the stream ended while idle
        call = self._call
        number = getattr(request, self.id_field)
        try:
            async with asyncio.timeout(self.timeout_s):  # a write can stall too (flow control)
                await call.write(request)
                response = await call.read()
        except asyncio.CancelledError:  # the router stops: this answer must not stay queued
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise Unavailable(f"{self.service} unavailable: no answer to {self.id_field} {number} "
                              f"within {self.timeout_s:g} s") from None
        except grpc.aio.AioRpcError as e:
            self.close()
            raise self.failed(e.code(), e.details(), stream_broke=True) from e
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as e:  # it ended between done() and write
            self.close()
            raise Unavailable(f"{self.service} unavailable: the stream ended ({e})") from e
        if response is grpc.aio.EOF:
            self.close()
            raise Unavailable(f"{self.service} unavailable: it ended the stream")
        if getattr(response, self.id_field) != number:  # cannot happen with one in flight; never misread
            self.close()
            raise Unavailable(f"{self.service} answered {self.id_field} {getattr(response, self.id_field)} to {number}")
        if response.HasField("error"):
            raise self.failed(_status(response.error.code), response.error.message)
        return response

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def failed(self, code: grpc.StatusCode, details: str, stream_broke: bool = False) -> TandemError:
        """The error of a failed call. `stream_broke`: the whole stream ended (not one answer's
        error): a peer killed mid-stream ends it UNAVAILABLE, or INTERNAL / UNKNOWN when its
        connection was reset under the stream ("RST_STREAM", "Stream removed"): gone all the same."""
        if code in _GONE or (stream_broke and code in _BROKEN):
            return Unavailable(f"{self.service} unavailable: {details}")
        return TandemError(f"{self.service} failed a call: {code.name}: {details}")


def _status(value: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)
