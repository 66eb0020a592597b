"""The router's conversions between the public protobuf API and its domain types, with the
validation that names the offending field. The only router module that imports generate_pb2."""

import uuid

from router.figures import RouterSnapshot
from router.request import Delta, GenerationSpec, Request
from router.tokenizer import Tokenizer
from tandem.errors import InvalidArgument
from tandem.figures import HistogramSnapshot
from tandem.sampling.params import SamplingParams
from tandem.v1 import generate_pb2 as pb

MAX_N = 64  # choices per request
# Each stop string is matched at every streamed character of every choice: bounded, so one
# request cannot stall the router's event loop (OpenAI takes 4; TGI 4 by default).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024


def prompt_ids(request, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Token ids of exactly one of prompt, messages, token_ids (GenerateRequest or TokenizeRequest)."""
    has_ids = bool(getattr(request, "token_ids", None))
    given = [name for name, set_ in (("prompt", bool(request.prompt)), ("messages", bool(request.messages)), ("token_ids", has_ids)) if set_]
    if len(given) != 1:
        what = "none" if not given else ", ".join(given)
        raise InvalidArgument(f"exactly one of prompt, messages, token_ids must be set and non-empty; got {what}")
    if given[0] == "prompt":
        ids = tokenizer.encode_prompt(request.prompt)
    elif given[0] == "messages":
        ids = tokenizer.encode_chat([(m.role, m.content) for m in request.messages])
    else:
        ids = list(request.token_ids)
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise InvalidArgument(f"token_ids[{i}] = {t}: outside the vocabulary [0, {vocab_size})")
    if not ids:
        raise InvalidArgument(f"{given[0]} encodes to no tokens")
    return ids


def sampler_from_pb(p: pb.SamplingParams, vocab_size: int) -> SamplingParams:
    sampler = SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        seed=p.seed if p.HasField("seed") else None,
        logprobs=p.logprobs or p.top_logprobs > 0,
        top_logprobs=p.top_logprobs,
        keyed_draws=p.HasField("seed"),  # reproducible whatever the schedule (keyed.py)
    )
    sampler.validate(vocab_size)
    return sampler


def spec_from_pb(
    request: pb.GenerateRequest,
    tokenizer: Tokenizer,
    *,
    vocab_size: int,
    max_context: int,
    default_max_tokens: int,
    max_sequence_tokens: int,
) -> GenerationSpec:
    ids = prompt_ids(request, tokenizer, vocab_size)
    p = request.params
    room = max_context - len(ids)
    if room < 1:
        raise InvalidArgument(f"prompt has {len(ids)} tokens; the context holds {max_context} (prompt + at least 1)")
    n = p.n if p.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise InvalidArgument(f"params.n = {n}: must be in [1, {MAX_N}]")
    # Unset: no more than the context, nor than this deployment can ever hold (its KV cache):
    # a default must not make a request fail that would fit with a smaller one.
    fits = max(max_sequence_tokens - len(ids), 1)  # below 1: refused by the scheduler, naming why
    max_tokens = p.max_tokens if p.HasField("max_tokens") else min(default_max_tokens, room, fits)
    if max_tokens < 1:
        raise InvalidArgument("params.max_tokens = 0: must be at least 1")
    if max_tokens > room:
        raise InvalidArgument(
            f"params.max_tokens = {max_tokens}: the prompt ({len(ids)} tokens) + max_tokens"
            f" exceeds the context of {max_context}"
        )
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"params.stop has {len(p.stop)} strings: at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(p.stop):
        if not s:
            raise InvalidArgument(f"params.stop[{i}] is empty")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"params.stop[{i}] has {len(s)} characters: at most {MAX_STOP_CHARS}")
    for i, t in enumerate(p.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"params.stop_token_ids[{i}] = {t}: outside the vocabulary [0, {vocab_size})")
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(tokenizer.eos_token_ids))
    return GenerationSpec(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=tuple(ids),
        sampler=sampler_from_pb(p, vocab_size),
        max_tokens=max_tokens,
        stop=tuple(p.stop),
        stop_token_ids=frozenset(stop_ids),
        speculate=p.speculate if p.HasField("speculate") else True,
        n=n,
    )


def delta_to_pb(request_id: str, delta: Delta, tokenizer: Tokenizer, want_logprobs: bool) -> pb.GenerateResponse:
    choice = pb.Choice(
        index=delta.index,
        text=delta.text,
        token_ids=[t.token_id for t in delta.tokens],
        finish_reason=delta.finish_reason.value if delta.finish_reason else "",
    )
    if want_logprobs:
        for t in delta.tokens:
            top = [pb.TopLogprob(token_id=i, logprob=lp, text=tokenizer.token_text(i)) for i, lp in t.top]
            choice.logprobs.append(pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob, top=top))
    return pb.GenerateResponse(request_id=request_id, choices=[choice])


def usage_to_pb(request: Request) -> pb.Usage:
    """Totals over the request's choices; the prompt counts once."""
    return pb.Usage(
        prompt_tokens=len(request.spec.prompt_ids),
        completion_tokens=sum(len(s.output_ids) for s in request.choices),
        cached_prompt_tokens=request.cached_prompt_tokens,
        draft_tokens=sum(s.draft_tokens for s in request.choices),
        accepted_draft_tokens=sum(s.accepted_draft_tokens for s in request.choices),
        verify_steps=sum(s.verify_steps for s in request.choices),
        accepted_by_depth=_sum_lists([s.accepted_by_depth for s in request.choices]),
    )


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out = [0] * max((len(x) for x in lists), default=0)
    for x in lists:
        for i, v in enumerate(x):
            out[i] += v
    return out



def stats_to_pb(s: RouterSnapshot) -> pb.StatsResponse:
    """Histograms go out summarised (count, sum, p50/p90/p99); every other field by its name."""
    fields = {}
    for name in RouterSnapshot.__dataclass_fields__:
        value = getattr(s, name)
        if isinstance(value, HistogramSnapshot):
            q = value.summary()
            value = pb.LatencySummary(count=q.count, sum=q.sum, p50=q.p50, p90=q.p90, p99=q.p99)
        if value is not None:
            fields[name] = value
    return pb.StatsResponse(**fields)
