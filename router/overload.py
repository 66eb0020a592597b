"""When a refused request may come back: the queue's recent drain rate.

A request refused because the waiting queue is full (max_waiting) is told how long the queue
ahead of it takes to drain at the rate requests have been finishing lately; gRPC clients with a
retry policy wait that long (the grpc-retry-pushback-ms trailer) instead of retrying at once into
the same full queue."""

import time
from collections import deque
from collections.abc import Callable

from tandem.errors import ResourceExhausted

MIN_RETRY_MS = 100  # never invite a client straight back
MAX_RETRY_MS = 60_000
UNKNOWN_RATE_RETRY_MS = 1_000  # nothing finished lately to estimate from


class QueueFull(ResourceExhausted):
    """The waiting queue holds max_waiting requests; `waiting`: how many are ahead."""

    def __init__(self, waiting: int):
        super().__init__(f"{waiting} requests already waiting (max_waiting)")
        self.waiting = waiting


# A pushback that tells a client with a retry policy not to retry at all (negative: gRPC's A6).
DO_NOT_RETRY_MS = -1


class NeverFits(ResourceExhausted):
    """A request that can never run under the engine's limits: retrying cannot help."""

    def __init__(self, why: str):
        super().__init__(why, retry_after_ms=DO_NOT_RETRY_MS)


class DrainRate:
    """Requests finished per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._finished: deque[float] = deque()  # when each finished, oldest first

    def record(self) -> None:
        """A request left the router (finished, cancelled or failed): its place is free."""
        now = self._clock()
        self._finished.append(now)
        self._forget(now)

    def _forget(self, now: float) -> None:
        while self._finished and self._finished[0] < now - self.window_s:
            self._finished.popleft()

    def per_second(self) -> float:
        now = self._clock()
        self._forget(now)
        if not self._finished:
            return 0.0
        span = max(now - self._finished[0], 1.0)  # a burst in the last instant is not a rate of thousands
        return len(self._finished) / span

    def retry_after_ms(self, ahead: int) -> int:
        """How long until `ahead` requests have drained, bounded to [MIN_RETRY_MS, MAX_RETRY_MS]."""
        rate = self.per_second()
        if rate <= 0:
            return UNKNOWN_RATE_RETRY_MS
        return int(min(max(ahead / rate * 1000, MIN_RETRY_MS), MAX_RETRY_MS))
