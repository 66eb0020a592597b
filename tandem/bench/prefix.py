"""`tandem bench --mode prefix`: the prefix cache on and off, side by side in one run.

Chat requests that share a long system prompt (as an assistant deployment sends them) are
served by two stacks (target + router processes), one with the cache and one without,
alternating question by question; each answers --max-tokens greedy tokens. Reported: time to
first token, time per request, prompt tokens served from the cache, and that the outputs agree.
"""

import statistics
import time
from pathlib import Path

from tandem.bench.machine import machine_facts, write_report
from tandem.bench.inputs import REDUCED_PROMPTS, bench_model
from tandem.bench.services import Devices, running_services
from tandem.channels import open_channel
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc

SYSTEM_ONCE = (
    "You are a careful, friendly assistant for a team of engineers. Answer in plain English, "
    "briefly, and say so when you are not sure. Prefer concrete examples over abstractions, "
    "name the assumptions you make, and keep code short and runnable. When a question is "
    "ambiguous, answer the most likely reading and mention the other. Never invent facts, "
    "figures or references; if something needs checking, say how to check it. "
)
SYSTEM = SYSTEM_ONCE * 4  # about 1,000 tokens; --reduced takes it once (the tiny model holds 512)


def _ask(stub, messages, max_tokens: int) -> tuple[list[int], float, float, int]:
    """(tokens, time to first token, total seconds, cached prompt tokens)."""
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages], params=params)
    started, first, tokens, cached = time.perf_counter(), None, [], 0
    for response in stub.Generate(request, timeout=3600):
        first = first or time.perf_counter()
        tokens.extend(response.choices[0].token_ids)
        if response.HasField("usage"):
            cached = response.usage.cached_prompt_tokens
    return tokens, first - started, time.perf_counter() - started, cached


def run_prefix_bench(args) -> int:
    from tandem.bench.data import mtbench_first_turns
    from tandem.models.fetch import tandem_home

    model = bench_model(args)
    count = min(args.questions, REDUCED_PROMPTS) if args.reduced else args.questions
    questions = mtbench_first_turns(tandem_home())[:count]
    system = SYSTEM_ONCE if args.reduced else SYSTEM
    off_flags = ("--prefix-cache-max-num-recycling-seqs", "0")
    devices = Devices.from_args(args)
    with running_services(model, args.dtype, args.threads, devices=devices) as on_addr, \
            running_services(model, args.dtype, args.threads, extra_router=off_flags, devices=devices) as off_addr:
        runs = {"on": [], "off": []}
        with open_channel(on_addr) as on, \
                open_channel(off_addr) as off:
            stubs = {"on": generate_pb2_grpc.GenerationStub(on), "off": generate_pb2_grpc.GenerationStub(off)}
            for i, q in enumerate(questions):
                order = ("on", "off") if i % 2 == 0 else ("off", "on")
                for side in order:
                    runs[side].append(_ask(stubs[side], [("system", system), ("user", q)], args.max_tokens))
    report = _report(args, model, runs, system)
    return write_report(report, args.out, "prefix", args.reduced, report["summary"])


def _side(runs) -> dict:
    return {
        "requests": len(runs),
        "ttft_ms_median": statistics.median(r[1] for r in runs) * 1e3,
        "ttft_ms_mean": statistics.fmean(r[1] for r in runs) * 1e3,
        "request_s_mean": statistics.fmean(r[2] for r in runs),
        "cached_prompt_tokens_total": sum(r[3] for r in runs),
    }


def _report(args, model: Path, runs: dict, system: str) -> dict:
    on, off = _side(runs["on"]), _side(runs["off"])
    same = sum(a[0] == b[0] for a, b in zip(runs["on"], runs["off"]))
    return {
        "mode": "prefix",
        "command": f"tandem bench --mode prefix --questions {args.questions} --max-tokens {args.max_tokens}"
                   f" --threads {args.threads}",
        "model": str(model),
        "dtype": args.dtype,
        "system_prompt_chars": len(system),
        "reduced": args.reduced,
        "cache_on": on,
        "cache_off": off,
        "summary": {
            "ttft_median_ratio_off_over_on": off["ttft_ms_median"] / on["ttft_ms_median"],
            "request_time_ratio_off_over_on": off["request_s_mean"] / on["request_s_mean"],
            "cached_prompt_tokens_on": on["cached_prompt_tokens_total"],
            "greedy_outputs_identical": f"{same}/{len(runs['on'])}",
        },
        "devices": Devices.from_args(args).record(with_draft=False),
        "machine": machine_facts(args.threads),
    }
