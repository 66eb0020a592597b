"""What flows on the target <-> draft peer stream, as domain types, and the target's end of it.

Target -> draft: for each step, the hidden states of every accepted position of the sequences
that speculate, each paired with the token one position later (the draft's input there).
Draft -> target: for each draft step, the distributions q the draft tokens were sampled from.
"""

import queue
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HiddenPairs:
    """Positions start .. start + n - 1 of one sequence: hidden[i] with tokens[i]."""

    seq_id: int
    start: int
    tokens: tuple[int, ...]
    hidden: torch.Tensor  # [n, hidden_size], or [n, len(layers) * hidden_size] for a peer's feature layers


@dataclass(frozen=True, slots=True)
class HiddenStep:
    step_id: int
    seqs: tuple[HiddenPairs, ...]
    trace_context: tuple[tuple[str, str], ...] = ()  # W3C headers of the target's step span


@dataclass(frozen=True, slots=True)
class DraftProbs:
    draft_step_id: int
    probs: dict  # seq_id -> [k, vocab] tensor


def one_torch_thread() -> None:
    """Called first on a thread that decodes peer messages. A new thread computes with the count
    torch was last set to (all cores by default), and OpenMP keeps a team per calling thread
    whose workers spin a while after every op on a vocabulary row, beside the compute thread's
    forward pass: sampled steps, whose proposal rows the target decodes, ran a third slower on 2
    cores (docs/benchmarks.md, the peer-stream threads). It also sets what threads started later
    begin with; the compute threads set their own count when they start."""
    torch.set_num_threads(1)


class TargetPeer:
    """The target's end: one draft peer at a time (a new one replaces the old). Sending never
    blocks a step; draft probabilities wait in a mailbox keyed by draft step id."""

    CLOSED = object()
    KEEP_DRAFT_STEPS = 64

    def __init__(self):
        self._out: queue.Queue | None = None
        self._probs: dict[int, dict] = {}
        self._cond = threading.Condition()
        # The peer's feature layers (its hello): the target layers whose inputs it reads, or ()
        # for the final-norm hidden state. Steps read it when they start.
        self.feature_layers: tuple[int, ...] = ()

    @property
    def connected(self) -> bool:
        return self._out is not None

    def attach(self, feature_layers: tuple[int, ...] = ()) -> queue.Queue:
        with self._cond:
            if self._out is not None:
                self._out.put(self.CLOSED)
            self._out = queue.Queue()
            self._probs.clear()
            self.feature_layers = tuple(feature_layers)
            return self._out

    def detach(self, out: queue.Queue) -> None:
        with self._cond:
            if self._out is out:
                self._out, self.feature_layers = None, ()  # no peer: no layers to capture
            self._cond.notify_all()

    def clear_probs(self) -> None:
        with self._cond:
            self._probs.clear()

    def send(self, step: HiddenStep) -> None:
        out = self._out
        if out is not None:
            out.put(step)

    def put_probs(self, message: DraftProbs) -> None:
        with self._cond:
            self._probs[message.draft_step_id] = message.probs
            for old in [s for s in self._probs if s < message.draft_step_id - self.KEEP_DRAFT_STEPS]:
                del self._probs[old]
            self._cond.notify_all()

    def take_probs(self, draft_step_id: int, timeout: float) -> dict | None:
        """The probabilities of that draft step, or None if they do not come in time."""
        with self._cond:
            self._cond.wait_for(lambda: draft_step_id in self._probs or self._out is None, timeout)
            return self._probs.pop(draft_step_id, None)
