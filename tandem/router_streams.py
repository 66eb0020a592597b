"""A model service's end of the router's long-lived stream (TargetEngine.Steps, DraftEngine.Drafts).

The router creates every sequence a model service holds. When its stream ends, the router went
away (killed, its host lost) or closed the stream to open another; either way the service drops
every sequence, so its KV pages return even if no router ever comes back. A stream that ends
after a newer one opened drops nothing: the router resets a service whenever it opens a stream
again, and the newer stream's sequences are not the old one's to drop.
"""

import logging
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


class RouterStreams:
    """`lock`: the engine's (its steps hold it); `drop`: drops every sequence, called under it."""

    def __init__(self, lock: threading.Lock, drop: Callable[[], None], service: str):
        self._lock = lock
        self._drop = drop
        self._service = service
        self._latest = 0  # streams opened so far: the latest one's number

    def follow(self, messages: Iterator) -> Iterator:
        """The stream's messages, passed through; its end (however it ends) drops the
        sequences unless a newer stream opened meanwhile."""
        with self._lock:
            self._latest += 1
            mine = self._latest
        try:
            yield from messages
        finally:
            with self._lock:
                if self._latest == mine:
                    log.info("%s: the router's stream ended: its sequences dropped", self._service)
                    self._drop()
