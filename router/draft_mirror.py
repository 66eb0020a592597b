"""The draft service's sequences as the router sees them. Pure: no gRPC, no tensors.

The draft holds a sequence for each sequence that speculates, one position behind the
target's (it is fed the target's hidden state of each position a step later), and keeps
recycled ones too: only those may be matched by a speculating root. The scheduler sends every
change of the target's sequences through `mirror`; what concerns the draft is queued for it.
"""

from collections.abc import Callable, Iterable
from dataclasses import replace

from router.request import Sequence
from tandem.ops import ForkSequence, RemoveSequence, SequenceOp

# A sequence re-prefills to speculate (the draft came back, or a place in it freed) only with
# this many tokens left to emit, and a quarter of its context: the re-prefill costs about its
# context in prefill tokens (10x cheaper than decode steps on CPU, 100x on GPUs), drafting saves
# 20-50% of each decode step still to come.
RESPECULATE_MIN_TOKENS_LEFT = 32


class DraftMirror:
    """`capacity()`: the sequences the draft service takes (its max_num_sequence as it last
    said; 0: unknown, taken as no limit)."""

    def __init__(self, capacity: Callable[[], int]):
        self.capacity = capacity
        self.held: set[int] = set()
        self.ops: list[SequenceOp] = []  # for the draft with the next step

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

    def lost(self) -> None:
        """The draft service failed: it holds nothing any more (it is reset when back)."""
        self.held.clear()
        self.ops.clear()

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


def choose_respeculations(candidates: list[Sequence], room: Callable[[int], bool]) -> list[Sequence]:
    """The candidates (oldest first) that re-prefill now: as many as the draft takes
    (`room(places)`: a parent takes 2, it and a child); the others are marked draft_denied and
    wait for a place to free. After one that finds no room, none after it is chosen."""
    chosen: list[Sequence] = []
    taken, full = 0, False
    for seq in candidates:
        places = 2 if seq.is_parent else 1
        if not full and room(taken + places):
            chosen.append(seq)
            taken += places
        else:
            seq.draft_denied = True
            full = full or places == 1  # no room for one: none for any after it
    return chosen


def worth_respeculating(seq: Sequence, speculates: Callable[[Sequence], bool] | None) -> bool:
    """A plain sequence re-prefills to speculate once at most: a draft that fails again right
    after it is back (its peer stream to the target down, say) must not restart a long prefill
    at every recovery."""
    if seq.draft_live or seq.respeculated or not (speculates and speculates(seq)):
        return False
    if seq.is_parent:  # it samples nothing itself; its children fork from it speculating
        return bool(seq.request.unactivated)
    left = seq.spec.max_tokens - len(seq.output_ids)
    context = len(seq.spec.prompt_ids) + len(seq.output_ids)
    return left >= max(RESPECULATE_MIN_TOKENS_LEFT, context // 4)
