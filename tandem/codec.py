"""Conversions between engine.proto messages and the domain types of tandem.ops.

Both ends of the router <-> model service protocol use these: the one place that knows both.
Tensor-free: the router, which never carries a tensor, imports no torch through it. The peer
stream's tensors (hidden states, draft probabilities) are tandem.peer_codec's.
"""

from tandem.errors import InvalidArgument
from tandem.ops import (
    AddSequence,
    DraftRequest,
    DraftResult,
    DraftSeq,
    EngineInfo,
    EngineStats,
    EntryKind,
    EntryResult,
    ForkSequence,
    LatencySummary,
    PopTokens,
    RemoveSequence,
    SampledToken,
    SequenceOp,
    StepEntry,
    StepRequest,
    StepResult,
)
from tandem.sampling.params import SamplingParams
from tandem.structured.spec import StructuredOutput
from tandem.v1 import engine_pb2 as pb
from tandem.v1 import generate_pb2

# -- sampler config ---------------------------------------------------------------------------


def sampler_to_pb(p: SamplingParams) -> pb.SamplerConfig:
    msg = pb.SamplerConfig(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        logit_bias=dict(p.logit_bias),
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
        keyed_draws=p.keyed_draws,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_pb(p.structured_output))
    return msg


def structured_output_to_pb(s: StructuredOutput) -> generate_pb2.StructuredOutput:
    if s.kind == "choice":
        return generate_pb2.StructuredOutput(choice=generate_pb2.Choices(values=s.value))
    return generate_pb2.StructuredOutput(**{s.kind: s.value})


def structured_output_from_pb(m: generate_pb2.StructuredOutput) -> StructuredOutput | None:
    """The public message (also inside SamplerConfig) as the domain value; None when no kind is
    set. Not yet validated (StructuredOutput.validate, then a backend's compile)."""
    kind = m.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput(kind, tuple(m.choice.values))
    return StructuredOutput(kind, getattr(m, kind))


def sampler_from_pb(m: pb.SamplerConfig) -> SamplingParams:
    return SamplingParams(
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        min_p=m.min_p,
        repetition_penalty=m.repetition_penalty,
        frequency_penalty=m.frequency_penalty,
        presence_penalty=m.presence_penalty,
        logit_bias=tuple(sorted(m.logit_bias.items())),
        seed=m.seed if m.HasField("seed") else None,
        logprobs=m.logprobs,
        top_logprobs=m.top_logprobs,
        keyed_draws=m.keyed_draws,
        structured_output=structured_output_from_pb(m.structured_output),
    )


# -- steps ------------------------------------------------------------------------------------


def op_to_pb(op: SequenceOp) -> pb.SequenceOp:
    if isinstance(op, AddSequence):
        add = pb.AddSequence(seq_id=op.seq_id, sampler=sampler_to_pb(op.sampler), num_prompt_tokens=op.num_prompt_tokens)
        return pb.SequenceOp(add=add)
    if isinstance(op, ForkSequence):
        fork = pb.ForkSequence(
            seq_id=op.seq_id, parent_id=op.parent_id, position=op.position, sampler=sampler_to_pb(op.sampler),
            num_prompt_tokens=op.num_prompt_tokens,
        )
        return pb.SequenceOp(fork=fork)
    if isinstance(op, PopTokens):
        return pb.SequenceOp(pop=pb.PopTokens(seq_id=op.seq_id, count=op.count))
    return pb.SequenceOp(remove=pb.RemoveSequence(seq_id=op.seq_id))


def op_from_pb(m: pb.SequenceOp) -> SequenceOp:
    kind = m.WhichOneof("op")
    if kind == "add":
        return AddSequence(m.add.seq_id, sampler_from_pb(m.add.sampler), m.add.num_prompt_tokens)
    if kind == "fork":
        f = m.fork
        return ForkSequence(f.seq_id, f.parent_id, f.position, sampler_from_pb(f.sampler),
                            num_prompt_tokens=f.num_prompt_tokens)
    if kind == "pop":
        return PopTokens(m.pop.seq_id, m.pop.count)
    if kind == "remove":
        return RemoveSequence(m.remove.seq_id)
    raise InvalidArgument("sequence op has no operation set")


def step_request_to_pb(r: StepRequest) -> pb.StepRequest:
    entries = [
        pb.StepEntry(
            seq_id=e.seq_id, kind=e.kind.value, token_ids=e.token_ids, sample=e.sample,
            num_draft_tokens=e.num_draft_tokens, emit_hidden=e.emit_hidden, tree_parents=e.tree_parents,
            sampled_tree=e.sampled_tree,
        )
        for e in r.entries
    ]
    ops = [op_to_pb(o) for o in r.ops]
    return pb.StepRequest(step_id=r.step_id, ops=ops, entries=entries, draft_step_id=r.draft_step_id)


def _entry_kind(value: int, index: int) -> EntryKind:
    try:
        return EntryKind(value)
    except ValueError:
        raise InvalidArgument(f"entries[{index}].kind = {value}: not an EntryKind") from None


def step_request_from_pb(m: pb.StepRequest) -> StepRequest:
    entries = tuple(
        StepEntry(e.seq_id, _entry_kind(e.kind, i), tuple(e.token_ids), e.sample, e.num_draft_tokens, e.emit_hidden,
                  tuple(e.tree_parents), e.sampled_tree)
        for i, e in enumerate(m.entries)
    )
    ops = tuple(op_from_pb(o) for o in m.ops)
    return StepRequest(step_id=m.step_id, ops=ops, entries=entries, draft_step_id=m.draft_step_id)


def step_result_to_pb(r: StepResult) -> pb.StepResponse:
    results = [
        pb.EntryResult(
            seq_id=e.seq_id,
            num_accepted=e.num_accepted,
            tokens=[
                pb.SampledToken(
                    token_id=t.token_id,
                    logprob=t.logprob,
                    top=[pb.SampledTop(token_id=i, logprob=lp) for i, lp in t.top],
                )
                for t in e.tokens
            ],
        )
        for e in r.results
    ]
    return pb.StepResponse(
        step_id=r.step_id, results=results, kv_pages_free=r.kv_pages_free, compute_ms=r.compute_ms
    )


def step_result_from_pb(m: pb.StepResponse) -> StepResult:
    results = tuple(
        EntryResult(
            seq_id=e.seq_id,
            tokens=tuple(
                SampledToken(t.token_id, t.logprob, tuple((x.token_id, x.logprob) for x in t.top))
                for t in e.tokens
            ),
            num_accepted=e.num_accepted,
        )
        for e in m.results
    )
    return StepResult(m.step_id, results, m.kv_pages_free, m.compute_ms)


# -- info and stats ---------------------------------------------------------------------------


def info_to_pb(i: EngineInfo) -> pb.EngineInfo:
    return pb.EngineInfo(**{f: getattr(i, f) for f in EngineInfo.__dataclass_fields__})


def info_from_pb(m: pb.EngineInfo) -> EngineInfo:
    return EngineInfo(**{f: getattr(m, f) for f in EngineInfo.__dataclass_fields__})


_STATS_FIELDS = tuple(f for f in EngineStats.__dataclass_fields__ if f != "step_seconds")


def stats_to_pb(s: EngineStats) -> pb.EngineStats:
    return pb.EngineStats(**{f: getattr(s, f) for f in _STATS_FIELDS}, step_seconds=latency_to_pb(s.step_seconds))


def latency_to_pb(s: LatencySummary) -> generate_pb2.LatencySummary:
    return generate_pb2.LatencySummary(count=s.count, sum=s.sum, p50=s.p50, p90=s.p90, p99=s.p99)


def latency_from_pb(m: generate_pb2.LatencySummary) -> LatencySummary:
    return LatencySummary(m.count, m.sum, m.p50, m.p90, m.p99)


# -- drafts -----------------------------------------------------------------------------------


def draft_request_to_pb(r: DraftRequest) -> pb.DraftRequest:
    return pb.DraftRequest(
        draft_step_id=r.draft_step_id,
        after_target_step=r.after_target_step,
        ops=[op_to_pb(o) for o in r.ops],
        seqs=[pb.DraftSeq(seq_id=s.seq_id, num_tokens=s.num_tokens) for s in r.seqs],
    )


def draft_request_from_pb(m: pb.DraftRequest) -> DraftRequest:
    return DraftRequest(
        draft_step_id=m.draft_step_id,
        after_target_step=m.after_target_step,
        ops=tuple(op_from_pb(o) for o in m.ops),
        seqs=tuple(DraftSeq(s.seq_id, s.num_tokens) for s in m.seqs),
    )


def draft_result_to_pb(r: DraftResult) -> pb.DraftResponse:
    parents = r.parents or {}
    seqs = [pb.DraftTokens(seq_id=s, token_ids=t, parents=parents.get(s, ()), sampled_tree=s in r.sampled_trees)
            for s, t in r.tokens.items()]
    return pb.DraftResponse(draft_step_id=r.draft_step_id, seqs=seqs, compute_ms=r.compute_ms)


def draft_result_from_pb(m: pb.DraftResponse) -> DraftResult:
    tokens = {s.seq_id: tuple(s.token_ids) for s in m.seqs}
    parents = {s.seq_id: tuple(s.parents) for s in m.seqs if s.parents}
    sampled = frozenset(s.seq_id for s in m.seqs if s.sampled_tree)
    return DraftResult(m.draft_step_id, tokens, m.compute_ms, parents, sampled)
