"""What the draft service asks of a draft method's engine (the seam a new method plugs into,
beside its entry in draft_service/methods.py). Imports no torch."""

from typing import Any, Protocol, runtime_checkable

from opentelemetry.trace import Span

from tandem.ops import DraftRequest, DraftResult, EngineStats
from tandem.router_streams import RouterStreams


@runtime_checkable
class DraftEngine(Protocol):
    """Built as `engine(config, head, peer, tracing=)` on the compute thread, which runs every
    call after. `head.config` gives Info its hidden and vocabulary sizes; `config` is the
    service's DraftConfig; `router_streams` drops a router's sequences when its stream ends."""

    head: Any
    config: Any
    router_streams: RouterStreams

    def draft(self, request: DraftRequest, span: Span) -> DraftResult:
        """Applies the request's sequence ops, then proposes each sequence's drafts."""
        ...

    def stats(self) -> EngineStats: ...

    def reset(self) -> EngineStats:
        """Drops every sequence (the router starts afresh)."""
        ...
