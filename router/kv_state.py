"""The router's view of the model services' KV: a page allocator fed the same operations as the
target's (the allocator is pure bookkeeping, so free pages are known exactly before a step is
sent) and the radix prefix cache. Pure: no gRPC, no asyncio, no tensors.

Every method that changes sequences returns the ops to send to the target, in order; the
caller sends them with the next step. The prefix cache mirrors the target's KV tokens: prompt
tokens as they are prefilled, then every token fed to a decode or verify step that was kept.
"""

from collections.abc import Callable, Sequence

from router.prefix_cache import NO_SLIDING_WINDOW, PrefixCache, plan_sequence_ops
from tandem.kv.pages import PageAllocator, pages_for
from tandem.ops import AddSequence, ForkSequence, RemoveSequence, SequenceOp
from tandem.sampling.params import SamplingParams


class KvState:
    def __init__(self, num_pages: int, page_size: int, max_held: int, max_recycling: int, sliding_window: int = 0):
        self.pages = PageAllocator(num_pages, page_size)
        self.cache = PrefixCache(max_recycling)
        self.max_held = max_held
        self.window = sliding_window or NO_SLIDING_WINDOW
        self.recycled_total = 0
        self.evicted_total = 0
        self.matched_tokens_total = 0  # tokens roots found in the prefix cache (resumed ones too)

    # -- queries ------------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return self.pages.num_free_pages

    @property
    def held(self) -> int:
        return self.pages.num_sequences

    def length(self, seq_id: int) -> int:
        return self.pages.length(seq_id)

    def pages_needed(self, seq_id: int, num_tokens: int) -> int:
        return self.pages.pages_needed(seq_id, num_tokens)

    def new_pages_bound(self, num_tokens: int) -> int:
        """Pages a new sequence's first `num_tokens` take at most, whatever it forks from."""
        return pages_for(num_tokens, self.pages.page_size) + 1

    # -- new sequences ------------------------------------------------------------------------

    def add_root(
        self,
        seq_id: int,
        tokens: Sequence[int],
        sampler: SamplingParams,
        *,
        draft_lags: bool,
        is_parent: bool = False,
        eligible: Callable[[int], bool] | None = None,
        num_prompt_tokens: int = 0,
    ) -> tuple[list[SequenceOp], int]:
        """Enters a sequence that will hold `tokens` (its prompt, or a resumed sequence's prompt
        + output: the first `num_prompt_tokens` are prompt), matched against the prefix cache;
        returns its ops and how many of its tokens are already in the KV. Parents get no
        sliding window (MLC-LLM: children fork them)."""
        window = NO_SLIDING_WINDOW if is_parent else self.window
        match = self.cache.insert_sequence(seq_id, tokens, window, eligible=eligible)
        plan = plan_sequence_ops(seq_id, match, draft_lags)
        if plan.cache_rollback:
            self.cache.rollback_sequence(seq_id, plan.cache_rollback)
        if plan.forked_seq_id is None:
            self.pages.add(seq_id)
            ops: list[SequenceOp] = [AddSequence(seq_id, sampler, num_prompt_tokens)]
        else:
            self.pages.fork(seq_id, plan.forked_seq_id, plan.fork_offset)
            ops = [ForkSequence(seq_id, plan.forked_seq_id, plan.fork_offset, sampler,
                                num_prompt_tokens=num_prompt_tokens)]
        if plan.reused_seq_id is not None:
            self.pages.remove(plan.reused_seq_id)
            ops.append(RemoveSequence(plan.reused_seq_id))
        self.matched_tokens_total += plan.num_prefilled
        return ops, plan.num_prefilled

    def fork_child(self, seq_id: int, parent_id: int, sampler: SamplingParams, draft_lags: bool,
                   num_prompt_tokens: int = 0) -> list[SequenceOp]:
        """A child shares all of its parent's KV (the prompt but its last token). A lagging
        draft forks one position earlier: the child's first pair comes from the target's
        carried last hidden state of the parent. `num_prompt_tokens` as in add_root."""
        position = self.pages.length(parent_id)
        self.pages.fork(seq_id, parent_id, position)
        self.cache.fork_sequence(seq_id, parent_id, position, self.window)
        draft_position = max(position - 1, 0) if draft_lags else None
        return [ForkSequence(seq_id, parent_id, position, sampler, draft_position=draft_position,
                             num_prompt_tokens=num_prompt_tokens)]

    # -- as steps run -------------------------------------------------------------------------

    def append(self, seq_id: int, num_tokens: int) -> None:
        self.pages.append(seq_id, num_tokens)

    def pop(self, seq_id: int, num_tokens: int) -> None:
        self.pages.pop(seq_id, num_tokens)

    def commit(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Tokens now in the target's KV for a live sequence."""
        self.cache.extend_sequence(seq_id, tokens)

    # -- ends ---------------------------------------------------------------------------------

    def recycle(self, seq_id: int) -> list[SequenceOp]:
        """A finished sequence stays for later prompts to match (up to the recycling limit)."""
        self.recycled_total += 1
        return self._removed(self.cache.recycle_sequence(seq_id))

    def remove(self, seq_id: int) -> list[SequenceOp]:
        self.cache.remove_sequence(seq_id)
        return self._removed([seq_id])

    def evict(self) -> list[SequenceOp]:
        """Frees the least recently recycled sequence; [] when none is left."""
        evicted = self._removed(self.cache.try_free_memory())
        self.evicted_total += len(evicted)
        return evicted

    def recycled_ids(self) -> list[int]:
        """Least recently recycled first (the order evictions take)."""
        return self.cache.recycled_ids()

    def reset(self) -> None:
        """The target dropped everything."""
        self.pages.clear()
        self.cache.reset()

    def _removed(self, seq_ids: list[int]) -> list[SequenceOp]:
        for seq_id in seq_ids:
            self.pages.remove(seq_id)
        return [RemoveSequence(s) for s in seq_ids]
