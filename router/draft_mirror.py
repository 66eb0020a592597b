"""The draft service's sequences as the router sees them, and each sequence's standing with
it. Pure: no gRPC, no tensors.

The draft holds a sequence for each sequence that speculates, one position behind the
target's (it is fed the target's hidden state of each position a step later), and keeps
recycled ones too: only those may be matched by a speculating root. The scheduler sends every
change of the target's sequences through `mirror`; what concerns the draft is queued for it.

A sequence that does not speculate may re-prefill to start (the draft rebuilds a sequence's
context only from the target's hidden states at every position, which a prefill makes): all of
them once the draft service is back after a failure, those the full draft turned away once a
place in it frees. `respeculations` is that policy, in one place.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tandem.ops import ForkSequence, RemoveSequence, SequenceOp

if TYPE_CHECKING:
    from router.request import Sequence

# A sequence re-prefills to speculate (the draft came back, or a place in it freed) only with
# this many tokens left to emit, and a quarter of its context: the re-prefill costs about its
# context in prefill tokens (10x cheaper than decode steps on CPU, 100x on GPUs), drafting saves
# 20-50% of each decode step still to come.
RESPECULATE_MIN_TOKENS_LEFT = 32


class Seat(enum.Enum):
    """A sequence's place in the draft service."""

    OFF = "off"  # none: it decodes plainly (no draft, a plain request, or the draft was lost)
    LIVE = "live"  # the draft holds it: it speculates
    DENIED = "denied"  # the draft was full when it came in: it takes a place that frees


@dataclass(slots=True)
class DraftState:
    """A sequence's draft state, one value: its seat and the re-prefills it took to speculate
    (one; a second when the first found the draft full on its way in)."""

    seat: Seat = Seat.OFF
    reprefills: int = 0

    @property
    def live(self) -> bool:
        return self.seat is Seat.LIVE

    def may_reprefill(self) -> bool:
        return self.reprefills == 0 or (self.reprefills == 1 and self.seat is Seat.DENIED)


class _Wake(enum.IntEnum):
    """Which sequences may re-prefill at the next step."""

    NONE = 0
    DENIED = 1  # a place freed: those the full draft turned away
    EVERY = 2  # the draft came back: every one that does not speculate


class DraftMirror:
    """`capacity()`: the sequences the draft service takes (its max_num_sequence as it last
    said; 0: unknown, taken as no limit). `speculates(seq)`: would a new root speculate now
    (a draft service is up and the request allows it)."""

    def __init__(self, capacity: Callable[[], int], speculates: Callable[[Sequence], bool] | None = None):
        self.capacity = capacity
        self.speculates = speculates
        self.held: set[int] = set()
        self.ops: list[SequenceOp] = []  # for the draft with the next step
        self._wake = _Wake.NONE

    def mirror(self, ops: Iterable[SequenceOp], speculates: bool) -> None:
        """The draft's side of target ops: new sequences that speculate (a child forks one
        position earlier there) and removals of what it holds."""
        for op in ops:
            if isinstance(op, RemoveSequence):
                self.drop(op.seq_id)
            elif speculates:
                if isinstance(op, ForkSequence) and op.draft_position is not None:
                    op = replace(op, position=op.draft_position, draft_position=None)
                self.held.add(op.seq_id)
                self.ops.append(op)

    def drop(self, seq_id: int) -> None:
        if seq_id in self.held:
            self.held.discard(seq_id)
            self.ops.append(RemoveSequence(seq_id))

    def lost(self, sequences: Iterable[Sequence]) -> None:
        """The draft service failed: it holds nothing any more (it is reset when back)."""
        self.held.clear()
        self.ops.clear()
        self._wake = _Wake.NONE
        for seq in sequences:
            if seq.draft.live:
                seq.draft.seat = Seat.OFF

    def back(self) -> None:
        """The draft service is healthy again (reset, holding nothing): every sequence that
        does not speculate may re-prefill to."""
        self._wake = _Wake.EVERY

    def freed(self, seq: Sequence, sequences: Iterable[Sequence]) -> None:
        """`seq` leaves the draft (or is recycled there: its place can be taken back): the
        sequences the full draft turned away may re-prefill."""
        if seq.draft.live and any(s.draft.seat is Seat.DENIED and self.worth_respeculating(s) for s in sequences):
            self._wake = max(self._wake, _Wake.DENIED)

    def reset(self) -> None:
        """The target dropped every sequence: the draft drops what it holds."""
        for seq_id in sorted(self.held):
            self.drop(seq_id)

    def take_ops(self) -> tuple[SequenceOp, ...]:
        ops, self.ops = tuple(self.ops), []
        return ops

    def room(self, places: int, recycled_ids: Callable[[], list[int]]) -> bool:
        """The draft takes `places` more sequences, once recycled ones it holds are dropped from
        it, least recently recycled first (`recycled_ids()`' order; the target keeps them for
        plain requests' prefix matches). None is dropped when that would not make room."""
        capacity = self.capacity()
        if not capacity or len(self.held) + places <= capacity:
            return True
        droppable = [s for s in recycled_ids() if s in self.held]
        excess = len(self.held) + places - capacity
        if excess > len(droppable):
            return False
        for seq_id in droppable[:excess]:
            self.drop(seq_id)
        return True

    @property
    def respeculation_due(self) -> bool:
        return self._wake is not _Wake.NONE

    def respeculations(self, sequences: Iterable[Sequence], room: Callable[[int], bool]) -> list[Sequence]:
        """The sequences (oldest first) that re-prefill now to speculate: those worth it, after a
        freed place only those the draft turned away, as many as the draft takes (`room(places)`:
        a parent takes 2, it and a child); the others are DENIED and wait for a place to free.
        After one that finds no room, none after it is chosen."""
        wake, self._wake = self._wake, _Wake.NONE
        chosen: list[Sequence] = []
        taken, full = 0, False
        for seq in sequences:
            if not ((wake is _Wake.EVERY or seq.draft.seat is Seat.DENIED) and self.worth_respeculating(seq)):
                continue
            places = 2 if seq.is_parent else 1
            if not full and room(taken + places):
                chosen.append(seq)
                seq.draft.reprefills += 1
                taken += places
            else:
                seq.draft.seat = Seat.DENIED
                full = full or places == 1  # no room for one: none for any after it
        return chosen

    def admitted(self, seq: Sequence, wants: bool, speculates: bool) -> None:
        """`seq` comes in (new, resumed, or re-prefilled): it speculates, or was turned away by
        a full draft it wanted."""
        seq.draft.seat = Seat.LIVE if speculates else Seat.DENIED if wants else Seat.OFF

    def worth_respeculating(self, seq: Sequence) -> bool:
        """A plain sequence re-prefills to speculate once (twice when the first found the draft
        full): a draft that fails again right after it is back (its peer stream to the target
        down, say) must not restart a long prefill at every recovery."""
        if seq.draft.live or not seq.draft.may_reprefill() or not (self.speculates and self.speculates(seq)):
            return False
        if seq.is_parent:  # it samples nothing itself; its children fork from it speculating
            return bool(seq.request.unactivated)
        left = seq.spec.max_tokens - len(seq.output_ids)
        context = len(seq.spec.prompt_ids) + len(seq.output_ids)
        return left >= max(RESPECULATE_MIN_TOKENS_LEFT, context // 4)
