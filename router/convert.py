"""The router's conversions between the public protobuf API and its domain types, with the
validation that names the offending field. The engine never sees protobuf: the adapters
(router/servicer.py, router/stream.py, router/http/) convert through here."""

import uuid

from router.figures import RouterSnapshot
from router.limits import RequestLimits
from router.request import Delta, GenerationSpec, Request
from router.tokenizer import CHAT_ROLES, Tokenizer
from tandem.errors import InvalidArgument
from tandem.figures import HistogramSnapshot
from tandem.sampling.params import SamplingParams
from tandem.codec import structured_output_from_pb
from tandem.v1 import generate_pb2 as pb

def _shown(text: str, width: int = 40) -> str:
    """A client's string quoted in an error, cut short: error details travel in trailers."""
    return repr(text) if len(text) <= width else f"{text[:width]!r}... ({len(text)} characters)"


def _utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def check_input(request, limits: RequestLimits) -> None:
    """The size caps of a request's id and input (GenerateRequest or TokenizeRequest), checked
    before anything is tokenized."""
    request_id = getattr(request, "request_id", "")
    if _utf8_bytes(request_id) > limits.max_request_id_bytes:
        raise InvalidArgument(f"request_id has {_utf8_bytes(request_id)} bytes: at most"
                              f" {limits.max_request_id_bytes} (max_request_id_bytes)")
    if not request_id.isprintable():  # it goes into logs and traces
        raise InvalidArgument(f"request_id = {_shown(request_id)}: control characters are not allowed")
    if _utf8_bytes(request.prompt) > limits.max_prompt_bytes:
        raise InvalidArgument(f"prompt has {_utf8_bytes(request.prompt)} bytes: at most"
                              f" {limits.max_prompt_bytes} (max_prompt_bytes)")
    if len(request.messages) > limits.max_messages:
        raise InvalidArgument(f"messages has {len(request.messages)} entries: at most {limits.max_messages} (max_messages)")
    for i, m in enumerate(request.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{i}].role = {_shown(m.role)}: must be one of {CHAT_ROLES}")
    content = sum(_utf8_bytes(m.content) for m in request.messages)
    if content > limits.max_prompt_bytes:
        raise InvalidArgument(f"messages hold {content} bytes of content: at most {limits.max_prompt_bytes} (max_prompt_bytes)")


def prompt_ids(request, tokenizer: Tokenizer, vocab_size: int, limits: RequestLimits) -> list[int]:
    """Token ids of exactly one of prompt, messages, token_ids (GenerateRequest or TokenizeRequest)."""
    check_input(request, limits)
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


def check_params(p: pb.SamplingParams, limits: RequestLimits, vocab_size: int) -> None:
    """The size caps of a request's sampling parameters and its stop conditions."""
    n = p.n if p.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        raise InvalidArgument(f"params.n = {n}: must be in [1, {limits.max_n}] (max_n)")
    if p.top_logprobs > limits.max_top_logprobs:
        raise InvalidArgument(f"params.top_logprobs = {p.top_logprobs}: at most {limits.max_top_logprobs} (max_top_logprobs)")
    if len(p.logit_bias) > limits.max_logit_bias:
        raise InvalidArgument(f"params.logit_bias has {len(p.logit_bias)} entries: at most {limits.max_logit_bias} (max_logit_bias)")
    if len(p.stop) > limits.max_stop_strings:
        raise InvalidArgument(f"params.stop has {len(p.stop)} strings: at most {limits.max_stop_strings} (max_stop_strings)")
    for i, s in enumerate(p.stop):
        if not s:
            raise InvalidArgument(f"params.stop[{i}] is empty")
        if len(s) > limits.max_stop_chars:
            raise InvalidArgument(f"params.stop[{i}] has {len(s)} characters: at most {limits.max_stop_chars} (max_stop_chars)")
    if len(p.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidArgument(f"params.stop_token_ids has {len(p.stop_token_ids)} entries: at most"
                              f" {limits.max_stop_token_ids} (max_stop_token_ids)")
    for i, t in enumerate(p.stop_token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"params.stop_token_ids[{i}] = {t}: outside the vocabulary [0, {vocab_size})")


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
        structured_output=structured_output_from_pb(p.structured_output),
    )
    sampler.validate(vocab_size)  # NaN and infinities included
    return sampler


def spec_from_pb(
    request: pb.GenerateRequest,
    tokenizer: Tokenizer,
    *,
    vocab_size: int,
    max_context: int,
    default_max_tokens: int,
    max_sequence_tokens: int,
    limits: RequestLimits,
) -> GenerationSpec:
    """Everything checked that needs no tokens first: a bad request is refused before its prompt
    is tokenized."""
    p = request.params
    check_params(p, limits, vocab_size)
    sampler = sampler_from_pb(p, vocab_size)
    if sampler.structured_output is not None:  # a spec that does not compile names its field
        tokenizer.grammars(vocab_size).compile(sampler.structured_output)
    if len(request.token_ids) >= max_context:  # before each id is read
        raise InvalidArgument(f"prompt has {len(request.token_ids)} tokens; the context holds {max_context} (prompt + at least 1)")
    ids = prompt_ids(request, tokenizer, vocab_size, limits)
    room = max_context - len(ids)
    if room < 1:
        raise InvalidArgument(f"prompt has {len(ids)} tokens; the context holds {max_context} (prompt + at least 1)")
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
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(tokenizer.eos_token_ids))
    return GenerationSpec(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=tuple(ids),
        sampler=sampler,
        max_tokens=max_tokens,
        n=p.n if p.HasField("n") else 1,
        stop=tuple(p.stop),
        stop_token_ids=frozenset(stop_ids),
        speculate=p.speculate if p.HasField("speculate") else True,
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
