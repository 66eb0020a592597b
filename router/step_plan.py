"""What one scheduler step decides (StepPlan) and what it has used so far (Room). Pure."""

from dataclasses import dataclass

from router.kv_state import KvState
from router.request import Sequence
from tandem.ops import SequenceOp, StepEntry


@dataclass(frozen=True, slots=True)
class StepPlan:
    ops: tuple[SequenceOp, ...]
    entries: tuple[StepEntry, ...]
    seqs: tuple[Sequence, ...]  # the sequence of each entry, in entry order
    draft_ops: tuple[SequenceOp, ...] = ()  # the same changes for the draft's sequences
    drafts_paused: bool = False  # it decodes spec_disable_batch_size sequences or more: no drafts

    @property
    def empty(self) -> bool:
        return not self.ops and not self.entries


@dataclass(slots=True)
class Room:
    """What one step has used so far: prompt tokens left, pages reserved for its decodes and
    taken by its chunks (the KV view's free pages change only at commit, or by evictions),
    total length of the live sequences."""

    tokens: int
    reserved: int
    length: int
    used_pages: int = 0

    def fits(self, kv: KvState, pages: int) -> bool:
        return pages <= kv.free_pages - self.reserved - self.used_pages

    def take(self, tokens: int, pages: int) -> None:
        self.tokens -= tokens
        self.used_pages += pages
        self.length += tokens
