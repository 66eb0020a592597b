"""Checks that run before a method's handler: who may call it (certificate identities) and
with which credentials (API keys). One interceptor per server kind wraps every handler with the
checks; a refused call ends with the check's status and never reaches the servicer.

A check is `check(method, context) -> Refusal | None`; `context` is the call's
grpc.ServicerContext (sync or aio: both have auth_context() and invocation_metadata())."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from tandem.grpc_server import rewrap_handler


@dataclass(frozen=True, slots=True)
class Refusal:
    code: grpc.StatusCode
    message: str


Check = Callable[[str, object], Refusal | None]

# Health and reflection stay open: probes and tools that list services present no credentials.
OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                           "grpc.reflection.v1.ServerReflection"})


def service_of(method: str) -> str:
    """"/tandem.v1.TargetEngine/Step" -> "tandem.v1.TargetEngine"."""
    return method.rsplit("/", 1)[0].lstrip("/")


def _first_refusal(checks: Sequence[Check], method: str, context) -> Refusal | None:
    for check in checks:
        refusal = check(method, context)
        if refusal is not None:
            return refusal
    return None


def _guard_sync(behavior: Callable, checks: Sequence[Check], method: str, response_streaming: bool) -> Callable:
    def unary(request, context):
        refusal = _first_refusal(checks, method, context)
        if refusal is not None:
            context.abort(refusal.code, refusal.message)
        return behavior(request, context)

    def streaming(request, context):
        refusal = _first_refusal(checks, method, context)
        if refusal is not None:
            context.abort(refusal.code, refusal.message)
        yield from behavior(request, context)

    return streaming if response_streaming else unary


def _guard_aio(behavior: Callable, checks: Sequence[Check], method: str, response_streaming: bool) -> Callable:
    async def unary(request, context):
        refusal = _first_refusal(checks, method, context)
        if refusal is not None:
            await context.abort(refusal.code, refusal.message)
        return await behavior(request, context)

    async def streaming(request, context):
        refusal = _first_refusal(checks, method, context)
        if refusal is not None:
            await context.abort(refusal.code, refusal.message)
        async for item in behavior(request, context):
            yield item

    return streaming if response_streaming else unary


def _guarded(handler, guard: Callable, checks: Sequence[Check], method: str):
    return rewrap_handler(handler, lambda behavior, _, response_streaming: guard(behavior, checks, method,
                                                                                  response_streaming))


class GuardInterceptor(grpc.ServerInterceptor):
    def __init__(self, checks: Sequence[Check]):
        self.checks = tuple(checks)

    def intercept_service(self, continuation, handler_call_details):
        return _guarded(continuation(handler_call_details), _guard_sync, self.checks, handler_call_details.method)


class AioGuardInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, checks: Sequence[Check]):
        self.checks = tuple(checks)

    async def intercept_service(self, continuation, handler_call_details):
        return _guarded(await continuation(handler_call_details), _guard_aio, self.checks, handler_call_details.method)
