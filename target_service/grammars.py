"""The target's grammar state (docs/structured-output.md): a matcher per constrained sequence,
beside the logits it masks.

A matcher is made at its sequence's first sampled step and brought to the sequence's output
before each sampled step (`SequenceGrammar.sync`): its tokens after `num_prompt_tokens`, or
after its prefills when that is 0. So a new, resumed, forked or popped sequence, or one this
target never saw before a restart, needs nothing else; n > 1 children are sequences of their own.
The step's mask rows are computed on a thread while the forward pass runs (llguidance drops the
GIL, as does torch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from tandem.ops import StepEntry
from tandem.sampling.params import SamplingParams
from tandem.structured.llguidance_backend import LlguidanceBackend
from tandem.structured.masks import chain_masks, tree_masks
from tandem.structured.matcher import SequenceGrammar

log = logging.getLogger(__name__)


class TargetGrammars:
    def __init__(self, model_dir: Path, vocab_size: int):
        self._model_dir, self.vocab_size = Path(model_dir), vocab_size
        self._backend: LlguidanceBackend | None = None  # made at the first constrained sequence
        self._params: dict[int, SamplingParams] = {}  # constrained sequences only
        self._prompt_end: dict[int, int] = {}
        self._counts_prefills: set[int] = set()  # num_prompt_tokens 0: the prompt ends with its prefills
        self._grammars: dict[int, SequenceGrammar] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.mask_seconds = 0.0  # total time spent computing mask rows, and how many
        self.mask_rows = 0

    @property
    def backend(self) -> LlguidanceBackend:
        if self._backend is None:
            self._backend = LlguidanceBackend.from_model_dir(self._model_dir, self.vocab_size)
        return self._backend

    def check(self, params: SamplingParams) -> None:
        """Compiles (or finds cached) a new sequence's grammar: InvalidArgument if it fails."""
        if params.structured_output is not None:
            self.backend.compile(params.structured_output)

    def added(self, seq_id: int, params: SamplingParams, num_prompt_tokens: int, length: int = 0) -> None:
        if params.structured_output is None:
            return
        self._params[seq_id] = params
        self._prompt_end[seq_id] = num_prompt_tokens or length
        if not num_prompt_tokens:
            self._counts_prefills.add(seq_id)

    def prefilled(self, seq_id: int, length: int) -> None:
        if seq_id in self._counts_prefills:
            self._prompt_end[seq_id] = length

    def removed(self, seq_id: int) -> None:
        for d in (self._params, self._prompt_end, self._grammars):
            d.pop(seq_id, None)
        self._counts_prefills.discard(seq_id)

    def clear(self) -> None:
        for d in (self._params, self._prompt_end, self._grammars):
            d.clear()
        self._counts_prefills.clear()

    def start(self, scored: Sequence[StepEntry], tokens: dict[int, list[int]]) -> Future | None:
        """The mask rows of the step's constrained entries, computing on the thread: a Future of
        {seq_id: [num_draft_tokens + 1, V] bool}. None when no entry is constrained."""
        work = [e for e in scored if e.seq_id in self._params]
        if not work:
            return None
        outputs = {e.seq_id: tokens[e.seq_id][self._prompt_end[e.seq_id] : len(tokens[e.seq_id]) - e.num_draft_tokens]
                   for e in work}
        return self._thread.submit(self._masks, work, outputs)

    def _masks(self, entries: Sequence[StepEntry], outputs: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        started, out = time.perf_counter(), {}
        for e in entries:
            grammar = self._grammars.get(e.seq_id)
            if grammar is None:
                compiled = self.backend.compile(self._params[e.seq_id].structured_output)
                grammar = SequenceGrammar(self.backend.new_matcher(compiled), self.backend.eos_token_ids)
                self._grammars[e.seq_id] = grammar
            grammar.sync(outputs[e.seq_id])
            k = e.num_draft_tokens
            if e.tree_parents:
                out[e.seq_id] = tree_masks(grammar, e.token_ids[-(k + 1):], e.tree_parents, self.vocab_size)
            else:
                out[e.seq_id] = chain_masks(grammar, e.token_ids[len(e.token_ids) - k :], self.vocab_size)
            self.mask_rows += k + 1
        self.mask_seconds += time.perf_counter() - started
        return out

    def emitted(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """The tokens a step emitted (drawn under the masks: in the grammar by construction)."""
        grammar = self._grammars.get(seq_id)
        for t in token_ids if grammar is not None else ():
            if not grammar.accept(t):
                log.error("sequence %d emitted token %d outside its grammar", seq_id, t)
                return


def allowed_rows(masks: dict[int, torch.Tensor], seq_ids: Sequence[int], vocab_size: int) -> torch.Tensor | None:
    """[len(seq_ids), V] bool of single-row masks (plain steps), all-allowed for unconstrained
    sequences; None when none is constrained."""
    if not any(s in masks for s in seq_ids):
        return None
    rows = torch.ones(len(seq_ids), vocab_size, dtype=torch.bool)
    for i, s in enumerate(seq_ids):
        if s in masks:
            rows[i] = masks[s][0]
    return rows
