"""Drafting in the router, from token ids alone (`--draft-method ngram`): no draft service, no
hidden states, no RPC. Each speculating decode proposes, as a chain, the tokens that followed
the latest earlier occurrence of its last n tokens (router/ngram.py). The drafts are point
masses: the target verifies them exactly as it does a draft service's, greedy or sampled.

It answers the engine as router/speculation.py's Speculator does (propose, mark_hidden, stats,
...), so the scheduler and the engine do not know which drafts.
"""

import dataclasses
from collections.abc import Callable

from router.ngram import NgramIndex
from router.request import Sequence
from router.speculation import SpecStats
from router.step_plan import StepPlan
from tandem.ops import EntryKind


class LookupDrafter:
    method = "ngram"
    shape = "chain"
    healthy = True  # nothing to lose: it runs in the router
    max_sequences = 0  # no limit of its own
    max_draft_tokens = 0  # a chain of k

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k = k
        self.min_n, self.max_n = min_n, max_n
        self.stats = SpecStats()

    def wants(self, seq: Sequence) -> bool:
        return seq.spec.speculate

    @staticmethod
    def mark_hidden(plan: StepPlan) -> StepPlan:
        return plan  # it drafts from tokens: the target streams no hidden states

    def take_back(self) -> bool:
        return False  # never down, never back

    async def propose(self, plan: StepPlan, after_step: int, cap: Callable[[Sequence], int],
                      trace=None) -> tuple[StepPlan, int, list[Sequence]]:
        """Each speculating decode entry gets up to min(k, cap(seq)) tokens of lookup, none past
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
            drafts = self._index(seq).propose(room) if room > 0 else ()
            if drafts:
                entries[i] = dataclasses.replace(entry, token_ids=entry.token_ids + drafts,
                                                 num_draft_tokens=len(drafts))
        return dataclasses.replace(plan, entries=tuple(entries)), 0, []

    def _index(self, seq: Sequence) -> NgramIndex:
        """The sequence's index, extended with its tokens since the last step (its prompt and
        output: the last output token is the one this step decodes)."""
        if seq.lookup is None:
            seq.lookup = NgramIndex(self.min_n, self.max_n)
        index = seq.lookup
        tokens = seq.spec.prompt_ids + tuple(seq.output_ids)
        index.extend(tokens[len(index.tokens):])
        return index

    def close(self) -> None:
        pass
