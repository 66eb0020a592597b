"""OpenAI response objects from tandem's deltas: chat.completion and text_completion, whole or as
stream chunks, with logprobs in each endpoint's format and usage with tandem's speculation
figures as an extension (`usage.speculation`).

Words: a token's text is its own decoded text (Tokenizer.token_text), its bytes that text's
UTF-8 (as vLLM gives them: a token that ends inside a character shows U+FFFD); text_offset
counts characters of the completion before the token, from its start."""

import math
import time

from router.http.openai_request import CHAT, OpenAIRequest
from router.request import Delta
from tandem.v1 import generate_pb2 as pb

NO_LOGPROB = -9999.0  # a logprob of -inf, which JSON cannot carry (vLLM's stand-in)


class Shaper:
    """The response objects of one request: its chunks as it streams (chunk, usage_chunk), or
    the whole response once it has finished (add each delta, then whole)."""

    def __init__(self, req: OpenAIRequest, request_id: str, model: str, tokenizer):
        self.req, self.model, self.tokenizer = req, model, tokenizer
        chat = req.kind == CHAT
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self._texts: dict[int, list[str]] = {}
        self._logprobs: dict[int, list] = {}  # chat: content entries; completions: its four lists
        self._finish: dict[int, str | None] = {}
        self._offsets: dict[int, int] = {}  # completions: characters of each choice so far
        self._token_texts: dict[int, str] = {}

    # streaming -----------------------------------------------------------------------------

    def chunk(self, delta: Delta) -> dict:
        if self.req.kind == CHAT:
            content = {"content": delta.text}
            if delta.index not in self._finish:  # its first chunk says who speaks
                content = {"role": "assistant", **content}
            choice = {"index": delta.index, "delta": content}
        else:
            choice = {"index": delta.index, "text": delta.text}
        self._finish[delta.index] = None
        choice["logprobs"] = self._delta_logprobs(delta) if self.req.logprobs else None
        choice["finish_reason"] = _reason(delta)
        return self._envelope(f"{self.object}.chunk" if self.req.kind == CHAT else self.object, [choice])

    def usage_chunk(self, usage: pb.Usage) -> dict:
        """stream_options.include_usage: a last chunk of no choices."""
        out = self._envelope(f"{self.object}.chunk" if self.req.kind == CHAT else self.object, [])
        out["usage"] = usage_dict(usage)
        return out

    # whole ---------------------------------------------------------------------------------

    def add(self, delta: Delta) -> None:
        self._texts.setdefault(delta.index, []).append(delta.text)
        self._finish[delta.index] = _reason(delta)
        if self.req.logprobs:
            piece = self._delta_logprobs(delta)
            if self.req.kind == CHAT:
                self._logprobs.setdefault(delta.index, []).extend(piece["content"])
            else:
                whole = self._logprobs.setdefault(delta.index, {key: [] for key in piece})
                for key, values in piece.items():
                    whole[key].extend(values)

    def whole(self, usage: pb.Usage) -> dict:
        choices = []
        for index in sorted(self._texts):
            text = "".join(self._texts[index])
            choice = {"index": index}
            if self.req.kind == CHAT:
                choice["message"] = {"role": "assistant", "content": text}
                logprobs = {"content": self._logprobs.get(index, []), "refusal": None}
            else:
                choice["text"] = text
                logprobs = self._logprobs.get(index)
            choice["logprobs"] = logprobs if self.req.logprobs else None
            choice["finish_reason"] = self._finish[index]
            choices.append(choice)
        out = self._envelope(self.object, choices)
        out["usage"] = usage_dict(usage)
        return out

    # shared --------------------------------------------------------------------------------

    def _envelope(self, object_: str, choices: list) -> dict:
        out = {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices}
        if self.req.include_usage:
            out["usage"] = None  # every chunk but the last, as OpenAI sends them
        return out

    def _text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.token_text(token_id)
        return text

    def _delta_logprobs(self, delta: Delta):
        if self.req.kind == CHAT:
            return {"content": [self._chat_entry(t.token_id, t.logprob, t.top) for t in delta.tokens], "refusal": None}
        tokens, offsets = [], []
        offset = self._offsets.get(delta.index, 0)
        for t in delta.tokens:
            tokens.append(self._text(t.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        self._offsets[delta.index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(t.logprob) for t in delta.tokens],
            "top_logprobs": [{self._text(i): _finite(lp) for i, lp in t.top} for t in delta.tokens],
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, logprob: float, top=None) -> dict:
        text = self._text(token_id)
        entry = {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}
        if top is not None:
            entry["top_logprobs"] = [self._chat_entry(i, lp) for i, lp in top]
        return entry


def usage_dict(usage: pb.Usage) -> dict:
    """OpenAI's usage (cached prompt tokens under prompt_tokens_details), and what speculation
    did for the request: draft tokens verified and accepted, verify steps, and per depth the
    verify steps whose accepted drafts reached it."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "speculation": {
            "draft_tokens": usage.draft_tokens,
            "accepted_draft_tokens": usage.accepted_draft_tokens,
            "verify_steps": usage.verify_steps,
            "accepted_by_depth": list(usage.accepted_by_depth),
        },
    }


def _reason(delta: Delta) -> str | None:
    return delta.finish_reason.value if delta.finish_reason else None


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_LOGPROB
