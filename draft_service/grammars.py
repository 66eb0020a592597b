"""The draft's grammar state (docs/structured-output.md, "Constrained drafts"): for a sequence
with structured_output, a matcher that the draft brings to the sequence's output at each call,
so that it proposes only tokens the grammar allows and proposes forced tokens free.

As in the target (target_service/grammars.py), a matcher holds token state only and is rebuilt
from the sequence's output whenever unknown: SequenceGrammar.sync rolls back to the common
prefix and consumes the rest. The draft learns the output from the real pairs it absorbs:
draft position i holds target token i + 1, so the tokens kept here (every sequence's, since a
constrained sequence may fork from any) are the target's less its first. The output starts at
`num_prompt_tokens`, which the router gives every constrained sequence (router/scheduler.py,
`_prompt_end`); without it the draft takes the sequence's first drafted call as the end of its
prompt (one whose first steps decoded without drafts would be misread: its matcher then refuses
its output and it drafts unconstrained, still lossless).
"""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.sampling.params import SamplingParams
from tandem.structured.drafting import DraftWalk
from tandem.structured.llguidance_backend import LlguidanceBackend
from tandem.structured.matcher import SequenceGrammar
from tandem.structured.spec import StructuredOutput

log = logging.getLogger(__name__)


class DraftGrammars:
    def __init__(self, target_model_dir: Path, vocab_size: int, enabled: bool = True):
        """enabled False (--no-constrained-drafts): every sequence drafts unconstrained."""
        self._model_dir, self.vocab_size, self.enabled = Path(target_model_dir), vocab_size, enabled
        self._backend: LlguidanceBackend | None = None  # made at the first constrained sequence
        self._tokens: dict[int, list[int]] = {}  # seq_id -> its real pairs' tokens
        self._specs: dict[int, StructuredOutput] = {}  # constrained sequences only
        self._output_start: dict[int, int | None] = {}  # index into _tokens; None: at the first draft
        self._grammars: dict[int, SequenceGrammar] = {}
        self._refused: set[int] = set()  # output outside the grammar: drafts unconstrained

    @property
    def backend(self) -> LlguidanceBackend:
        if self._backend is None:
            self._backend = LlguidanceBackend.from_model_dir(self._model_dir, self.vocab_size)
        return self._backend

    def added(self, seq_id: int, params: SamplingParams, num_prompt_tokens: int, tokens=()) -> None:
        if not self.enabled:
            return
        self._tokens[seq_id] = list(tokens)
        if params.structured_output is not None:
            self._specs[seq_id] = params.structured_output
            self._output_start[seq_id] = num_prompt_tokens - 1 if num_prompt_tokens > 0 else None

    def forked(self, seq_id: int, parent_id: int, position: int, params: SamplingParams, num_prompt_tokens: int) -> None:
        """The child shares the parent's first `position` draft positions."""
        if self.enabled:
            self.added(seq_id, params, num_prompt_tokens, self._tokens.get(parent_id, [])[:position])

    def absorbed(self, seq_id: int, start: int, tokens) -> None:
        """Real pairs at draft positions start, start + 1, ... came (into the KV, for EAGLE). A gap
        before them (pairs the draft never got) leaves its output unknown: it drafts unconstrained."""
        mine = self._tokens.get(seq_id)
        if mine is None:
            return
        if start > len(mine):
            self._refused.add(seq_id)
        del mine[start:]
        mine.extend(tokens)

    def truncated(self, seq_id: int, length: int) -> None:
        if (mine := self._tokens.get(seq_id)) is not None:
            del mine[length:]

    def popped(self, seq_id: int, count: int) -> None:
        if (mine := self._tokens.get(seq_id)) is not None and count > 0:
            del mine[-count:]

    def removed(self, seq_id: int) -> None:
        for d in (self._tokens, self._specs, self._output_start, self._grammars):
            d.pop(seq_id, None)
        self._refused.discard(seq_id)

    def clear(self) -> None:
        for d in (self._tokens, self._specs, self._output_start, self._grammars):
            d.clear()
        self._refused.clear()

    def walk(self, seq_id: int) -> DraftWalk | None:
        """The sequence's grammar standing after its output, for one draft call (close it after);
        None when it drafts unconstrained."""
        spec = self._specs.get(seq_id)
        if spec is None or seq_id in self._refused:
            return None
        tokens = self._tokens[seq_id]
        start = self._output_start[seq_id]
        if start is None:  # its first drafted call: its last pair holds its first output token
            start = self._output_start[seq_id] = max(len(tokens) - 1, 0)
        grammar = self._grammars.get(seq_id)
        if grammar is None:
            compiled = self.backend.compile(spec)
            grammar = self._grammars[seq_id] = SequenceGrammar(self.backend.new_matcher(compiled),
                                                               self.backend.eos_token_ids)
        if not grammar.sync(tokens[start:]):
            log.info("sequence %d: its output as the draft read it is outside its grammar; drafting it unconstrained", seq_id)
            self._refused.add(seq_id)
            return None
        return DraftWalk(grammar, self.vocab_size)
