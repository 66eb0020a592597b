"""The client side of a tandem benchmark row: concurrent Generate streams against a router, the
Usage of each, and the router's Stats counters before and after."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tandem.loops import loops
from tandem.v1 import generate_pb2 as pb

# Router Stats counters the time split differences (all cumulative since the router started).
STAT_COUNTERS = ("steps_total", "step_ms_total", "target_compute_ms_total", "draft_ms_total",
                 "draft_compute_ms_total")


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """What one request's last GenerateResponse.usage said, and whether its completion loops."""

    completion_tokens: int
    verify_steps: int
    accepted_draft_tokens: int
    accepted_by_depth: tuple[int, ...]
    looping: bool  # the completion repeats itself (tandem.loops)


def generate_one(stub, ids: list[int], max_tokens: int, temperature: float) -> StreamUsage:
    """Exactly max_tokens tokens (eos ignored). Unseeded when sampling, as most requests are: a
    seed would draw keyed, its drafts verified against its own draw (tandem/sampling/keyed.py)
    rather than by speculative sampling."""
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    return stream_usage(stub.Generate(pb.GenerateRequest(token_ids=ids, params=params), timeout=3600))


def stream_usage(responses) -> StreamUsage:
    """The Usage of a Generate stream's last message, with its tokens (all messages') checked
    against it: the loop count must read whole completions."""
    usage, tokens = None, []
    for response in responses:
        tokens += [t for choice in response.choices for t in choice.token_ids]
        if response.HasField("usage"):
            usage = response.usage
    if len(tokens) != usage.completion_tokens:
        raise RuntimeError(f"the stream carried {len(tokens)} tokens, its usage counts {usage.completion_tokens}")
    return StreamUsage(usage.completion_tokens, usage.verify_steps, usage.accepted_draft_tokens,
                       tuple(usage.accepted_by_depth), loops(tokens))


def generate_group(stub, group: list[list[int]], max_tokens: int, temperature: float) -> list[StreamUsage]:
    """The group's prompts as concurrent streams (one thread each); returns when all are done."""
    with ThreadPoolExecutor(len(group)) as pool:
        return list(pool.map(lambda ids: generate_one(stub, ids, max_tokens, temperature), group))


def stats_counters(stub) -> dict[str, float]:
    s = stub.Stats(pb.StatsRequest(), timeout=10)
    return {name: getattr(s, name) for name in STAT_COUNTERS}


def time_split(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """Where a row's wall time went, as fractions: the target's compute, the draft's (its wait
    for the target's hidden states included), the two RPCs' overhead (wall time of the call less
    the service's own time), and the rest (the router's loop and the clients' streams)."""
    d = {k: after[k] - before[k] for k in STAT_COUNTERS}
    wall_ms = wall_s * 1e3
    parts = {
        "target": d["target_compute_ms_total"],
        "draft": d["draft_compute_ms_total"],
        "target_rpc": d["step_ms_total"] - d["target_compute_ms_total"],
        "draft_rpc": d["draft_ms_total"] - d["draft_compute_ms_total"],
    }
    parts["router_and_client"] = max(wall_ms - d["step_ms_total"] - d["draft_ms_total"], 0.0)
    steps = max(int(d["steps_total"]), 1)
    overhead = parts["target_rpc"] + parts["draft_rpc"] + parts["router_and_client"]
    return {
        "steps": int(d["steps_total"]),
        "mean_step_ms": round(wall_ms / steps, 3),  # wall per target step, drafting included
        "fractions": {k: round(v / wall_ms, 4) for k, v in parts.items()},
        "rpc_and_router_fraction": round(overhead / wall_ms, 4),
    }
