"""Drafting in the router, from token ids alone (`--local-draft ngram|suffix`): no draft service,
no hidden states, no RPC. The drafts are point masses: the target verifies them exactly as it
does a draft service's, greedy or sampled.

- ngram: a chain of the tokens that followed the latest earlier occurrence of the sequence's
  last n tokens (router/ngram.py).
- suffix: a tree of likely continuations, from what followed the sequence's recent tokens in
  its own prompt and output and in the recent outputs of other requests (router/suffix.py).

It answers the engine as router/speculation.py's Speculator does (propose, mark_hidden, stats,
...), so the scheduler and the engine do not know which drafts.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from router.ngram import NgramIndex
from router.request import Sequence
from router.speculation import SpecStats
from router.step_plan import StepPlan
from router.suffix import ContextCounts, RecentOutputs, propose_tree
from tandem.ops import EntryKind


@dataclass(frozen=True, slots=True)
class LookupConfig:
    method: str  # "ngram" or "suffix"
    k: int  # draft tokens a step: a chain's length, a suffix tree's nodes
    min_n: int = 2
    max_n: int = 4
    suffix_depth: int = 6  # the longest context whose followers are counted
    suffix_cache_tokens: int = 65536  # recent outputs of other requests kept for suffix drafting
    suffix_min_score: float = 0.1  # a node's estimated chance of being reached, at least


@dataclass(slots=True)
class _Counted:
    """A sequence's context counts and how many of its tokens they hold."""

    counts: ContextCounts
    tokens: int = 0


class LookupDrafter:
    healthy = True  # nothing to lose: it runs in the router
    max_sequences = 0  # no limit of its own
    max_draft_tokens = 0  # k tokens a step, a chain's or a tree's

    def __init__(self, config: LookupConfig):
        self.config = config
        self.method, self.k = config.method, config.k
        self.shape = "tree" if config.method == "suffix" else "chain"
        self.stats = SpecStats()
        self._recent = RecentOutputs(config.suffix_depth, config.suffix_cache_tokens) if config.method == "suffix" else None

    def wants(self, seq: Sequence) -> bool:
        return seq.spec.speculate

    @staticmethod
    def mark_hidden(plan: StepPlan) -> StepPlan:
        return plan  # it drafts from tokens: the target streams no hidden states

    def take_back(self) -> bool:
        return False  # never down, never back

    def finished(self, seq: Sequence) -> None:
        """A choice finished: its output joins the recent outputs other requests draft from."""
        if self._recent is not None and seq.output_ids:
            self._recent.add(seq.output_ids)

    async def propose(self, plan: StepPlan, after_step: int, cap: Callable[[Sequence], int],
                      trace=None) -> tuple[StepPlan, int, list[Sequence]]:
        """Each speculating decode entry gets up to min(k, cap(seq)) draft tokens, none past
        what the request may still emit; returns the plan, draft step 0 (no draft service: the
        target waits for no proposal rows) and no unserved sequence (one with no match this
        step decodes plainly and drafts again at the next)."""
        if plan.drafts_paused:
            self.stats.paused_steps += any(s.draft_live for s in plan.seqs)
            return plan, 0, []
        entries = list(plan.entries)
        for i, (entry, seq) in enumerate(zip(plan.entries, plan.seqs)):
            if entry.kind is not EntryKind.DECODE or not seq.draft_live:
                continue
            room = min(self.k, cap(seq), seq.spec.max_tokens - len(seq.output_ids) - 1)
            drafts, parents = self._draft(seq, room) if room > 0 else ((), ())
            if drafts:
                chain = parents == tuple(range(len(parents)))
                entries[i] = dataclasses.replace(entry, token_ids=entry.token_ids + drafts, num_draft_tokens=len(drafts),
                                                 tree_parents=() if chain else parents)
        return dataclasses.replace(plan, entries=tuple(entries)), 0, []

    def _draft(self, seq: Sequence, room: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The sequence's tokens (prompt and output: the last output token is the one this
        step decodes), indexed since the last step, and its drafts."""
        tokens = seq.spec.prompt_ids + tuple(seq.output_ids)
        c = self.config
        if c.method == "ngram":
            if seq.lookup is None:
                seq.lookup = NgramIndex(c.min_n, c.max_n)
            seq.lookup.extend(tokens[len(seq.lookup.tokens):])
            drafts = seq.lookup.propose(room)
            return drafts, tuple(range(len(drafts)))
        if seq.lookup is None:
            seq.lookup = _Counted(ContextCounts(c.suffix_depth))
        seq.lookup.counts.add(tokens, seq.lookup.tokens)
        seq.lookup.tokens = len(tokens)
        return propose_tree(tokens, [seq.lookup.counts, self._recent.counts], room, c.suffix_min_score)

    def close(self) -> None:
        pass
