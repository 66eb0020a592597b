"""Turns the tokens a step emitted for one request into a stream delta: detokenization, stop
token ids, stop strings and max_tokens. Pure: no gRPC, no asyncio."""

from collections.abc import Sequence

from router.detokenizer import IncrementalDetokenizer
from router.request import Delta, FinishReason, TokenOut
from router.request import Sequence as RequestSeq
from router.stops import StopStringMatcher
from tandem.ops import SampledToken


class OutputProcessor:
    """One per choice (a sequence that samples); owns its detokenizer and stop-string matcher."""

    def __init__(self, state: RequestSeq, hf_tokenizer):
        self.state = state
        self._detok = IncrementalDetokenizer(hf_tokenizer, state.spec.prompt_ids)
        self._stops = StopStringMatcher(state.spec.stop)
        self._matched_stop = False  # after a stop-string match nothing more is shown

    def process(self, sampled: Sequence[SampledToken]) -> Delta:
        """Appends the emitted tokens until one finishes the choice; returns its delta."""
        state, spec = self.state, self.state.spec
        text, tokens = [], []
        for t in sampled:
            state.output_ids.append(t.token_id)
            tokens.append(TokenOut(t.token_id, t.logprob, t.top))
            if t.token_id in spec.stop_token_ids:
                state.finish_reason = FinishReason.STOP  # the stop token's text is not shown
                break
            piece, stopped = self._stops.push(self._detok.push([t.token_id]))
            text.append(piece)
            if stopped:
                state.finish_reason = FinishReason.STOP
                self._matched_stop = True
                break
            if len(state.output_ids) >= spec.max_tokens:
                state.finish_reason = FinishReason.LENGTH
                break
        if state.finished:
            text.append(self._drain())
        return Delta("".join(text), tuple(tokens), state.finish_reason, state.index)

    def cancel(self) -> Delta:
        self.state.finish_reason = FinishReason.CANCELLED
        return Delta("", (), FinishReason.CANCELLED, self.state.index)

    def _drain(self) -> str:
        """Text held back by the detokenizer and the stop matcher, at the end of generation."""
        if self._matched_stop:
            return ""
        piece, stopped = self._stops.push(self._detok.flush())
        return piece if stopped else piece + self._stops.flush()
