"""The draft's end of the peer stream: connects to the target, buffers the hidden states of each
sequence until a Draft call absorbs them, and sends draft probabilities back."""

import logging
import queue
import threading
from collections.abc import Callable

import grpc
import torch

from tandem import peer_codec
from tandem.errors import Unavailable
from tandem.channels import open_channel
from tandem.peer import DraftProbs, HiddenPairs, one_torch_thread
from tandem.security.tls import PLAINTEXT, TlsConfig
from tandem.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)
RECONNECT_S = 0.5
REFUSED_RETRY_S = 5.0  # a target that refused the hello is asked again (it may be replaced)
# The target will not serve this draft: another model, or (mutual TLS) another identity.
_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
KEEP_TRACE_CONTEXTS = 16  # target steps whose trace context is kept (a Draft call asks for the last)


class DraftPeer:
    def __init__(self, target_address: str, device="cpu", tls: TlsConfig = PLAINTEXT,
                 on_connected: Callable[["DraftPeer"], None] = lambda peer: None):
        self.target_address = target_address
        self.tls = tls  # read at each connection: rotated certificates are used from the next
        self.device = device
        self._pending: dict[int, list[HiddenPairs]] = {}
        self._last_step = 0
        self._trace_contexts: dict[int, tuple[tuple[str, str], ...]] = {}  # step id -> W3C headers
        self._connected = False
        self._cond = threading.Condition()
        self._outgoing: tuple[queue.Queue, torch.Tensor | None] | None = None  # this stream's queue, its columns
        self._stop = threading.Event()
        self.columns: torch.Tensor | None = None  # a pruned draft vocabulary's token ids (use_columns)
        self.feature_layers: tuple[int, ...] = ()  # the target layers the head reads (use_features)
        self.feature_width: int | None = None  # the width of the hidden states it reads
        self.refusal: str | None = None  # why the target last refused the stream (INVALID_ARGUMENT)
        self._width_warned = False  # one warning a stream for hidden states of another width
        self.on_connected = on_connected  # the stream opened or closed: the server's health follows
        self._target_instance = ""  # EngineInfo.instance_id of the target streamed from
        self._new_instance = False  # this stream's target is another process than the last one's

    def use_features(self, layers: tuple[int, ...], width: int) -> None:
        """The target layers whose inputs the head reads (EAGLE-3's aux layers; () for the
        final-norm hidden state) and the width of what it reads: each stream opened from now on
        asks for them, and hidden states of another width are dropped, not drafted from."""
        self.feature_layers, self.feature_width = tuple(layers), width

    def use_columns(self, columns: torch.Tensor | None) -> None:
        """The token ids of the draft's pruned vocabulary, outside which its proposals are zero:
        each stream opened from now on sends them first, then proposal rows as their entries
        only (a third of this model's vocabulary on the wire). Sent sorted, as the target wants."""
        self.columns = None if columns is None else torch.unique(columns)

    def start(self) -> None:
        threading.Thread(target=self._run, name="draft-peer", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        outgoing = self._outgoing
        if outgoing is not None:
            outgoing[0].put(None)

    @property
    def connected(self) -> bool:
        return self._connected

    def wait_connected(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._connected, timeout)

    def wait_step(self, step_id: int, timeout: float) -> bool:
        """True once the hidden states of target step `step_id` (and all before) are here."""
        with self._cond:
            return self._cond.wait_for(lambda: self._last_step >= step_id, timeout)

    def trace_context(self, step_id: int) -> tuple[tuple[str, str], ...]:
        """The W3C headers of the target's span of step `step_id` (empty if it was not traced)."""
        with self._cond:
            return self._trace_contexts.get(step_id, ())

    def take(self, seq_id: int) -> list[HiddenPairs]:
        with self._cond:
            return self._pending.pop(seq_id, [])

    def drop(self, seq_id: int) -> None:
        with self._cond:
            self._pending.pop(seq_id, None)

    def clear(self) -> None:
        """A fresh router (step ids go on from the target's last one: see Reset)."""
        with self._cond:
            self._pending.clear()

    def retain(self, seq_ids: set[int]) -> None:
        """Drops buffered pairs of sequences the draft does not hold (removed, or never added)."""
        with self._cond:
            for seq_id in [s for s in self._pending if s not in seq_ids]:
                del self._pending[seq_id]

    def send_probs(self, probs: DraftProbs) -> None:
        outgoing = self._outgoing
        if outgoing is not None:
            out, columns = outgoing
            out.put(peer_codec.draft_probs_to_pb(probs, columns))

    def _run(self) -> None:
        one_torch_thread()  # it decodes hidden states while the target computes
        while not self._stop.is_set():
            refused = False
            try:
                self._stream_once()
            except grpc.RpcError as e:
                refused = isinstance(e, grpc.Call) and e.code() in _REFUSALS
                if refused:  # the target will not serve this head (another model? identity?): say why, once
                    if e.details() != self.refusal:
                        log.error("draft: the target at %s refused the peer stream: %s", self.target_address, e.details())
                    self.refusal = e.details()
                elif self._connected:
                    log.warning("draft: peer stream to %s lost: %s", self.target_address, e)
            except grpc.FutureTimeoutError as e:
                if self._connected:
                    log.warning("draft: peer stream to %s lost: %s", self.target_address, e)
            except Exception:  # the thread must live on, or speculation never comes back
                log.exception("draft: peer stream failed")
            finally:
                if self._connected:
                    self._connected = False
                    self.on_connected(self)
            self._stop.wait(REFUSED_RETRY_S if refused else RECONNECT_S)

    def _stream_once(self) -> None:
        with open_channel(self.target_address, self.tls) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            info = engine_pb2_grpc.TargetEngineStub(channel).Info(engine_pb2.InfoRequest(), timeout=30)
            self._begin_stream(info.instance_id)
            out: queue.Queue = queue.Queue()
            columns = self.columns
            out.put(peer_codec.peer_hello_to_pb(self.feature_layers, columns))  # before any rows on the columns
            self._outgoing = (out, columns)
            requests = iter(out.get, None)
            stream = engine_pb2_grpc.TargetEngineStub(channel).Peer(requests)
            try:
                for message in stream:  # the first one is the target's hello: attached
                    self._receive(peer_codec.hidden_step_from_pb(message, self.device))
            finally:
                self._outgoing = None
                out.put(None)

    def _begin_stream(self, instance_id: str) -> None:
        self._new_instance = instance_id != self._target_instance
        self._target_instance = instance_id

    def _receive(self, step) -> None:
        opened = not self._connected
        with self._cond:
            if opened:
                self._connected, self._width_warned, self.refusal = True, False, None
                if self._new_instance:  # a restarted target (and router) count steps afresh
                    self._last_step = step.step_id
                    self._trace_contexts.clear()
                log.info("draft: peer stream to %s open", self.target_address)
            for pairs in step.seqs:
                if self.feature_width is not None and pairs.hidden.shape[-1] != self.feature_width:
                    if not self._width_warned:
                        log.warning("draft: hidden states of width %d dropped, the head reads %d: a target that "
                                    "ignores the feature layers of its hello?", pairs.hidden.shape[-1], self.feature_width)
                        self._width_warned = True
                    continue  # a gap: the sequence drafts no more, as after a lost stream
                self._pending.setdefault(pairs.seq_id, []).append(pairs)
            self._last_step = max(self._last_step, step.step_id)
            if step.trace_context:
                self._trace_contexts[step.step_id] = step.trace_context
                for old in [s for s in self._trace_contexts if s <= step.step_id - KEEP_TRACE_CONTEXTS]:
                    del self._trace_contexts[old]
            self._cond.notify_all()
        if opened:  # outside the lock: a health watcher may block the callback
            self.on_connected(self)


def wait_for_hidden_states(peer, after_target_step: int, timeout_s: float) -> None:
    """A Draft call starts once the target's hidden states of every step up to
    `after_target_step` are here; ops-only calls wait too: a remove must not overtake its
    sequence's last hidden states."""
    if not peer.connected:
        raise Unavailable(f"draft: no peer stream to the target at {peer.target_address}")
    if not peer.wait_step(after_target_step, timeout_s):
        raise Unavailable(f"draft: hidden states of target step {after_target_step} never came")


__all__ = ["DraftPeer", "wait_for_hidden_states"]
