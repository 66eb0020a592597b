"""`tandem bench --mode spec`: speculation compared in one run on one machine. On MT-bench first
turns, greedy and at temperature 1 (tandem unseeded), at batch 1 and with --concurrency streams:
transformers' generate and prompt lookup, tandem plain, EAGLE chain, EAGLE tree and Medusa.

Every stack runs from the start; within a cell (temperature, batch) the modes take turns group by
group, in a rotating order, so that drift in the machine's speed touches all alike. Each request
generates exactly --max-tokens tokens (eos ignored), so every mode does the same work.
"""

import contextlib
import os
import time
from pathlib import Path

from tandem.bench.hf import HFGenerator
from tandem.bench.inputs import bench_model, bench_prompts
from tandem.bench.services import bench_kv_cache_tokens, running_stacks
from tandem.bench.spec_modes import Mode, SpecBenchConfig, plan_modes, spec_config
from tandem.bench.spec_runners import HFRunner, Refused, Tally, TandemRunner, timed
from tandem.bench.streams import time_split
from tandem.channels import open_channel
from tandem.v1 import generate_pb2_grpc


def run_spec_bench(args) -> int:
    from transformers import AutoTokenizer

    from tandem.bench.spec_report import build_report, write_results

    cfg = spec_config(args)
    load = os.getloadavg()[0]  # before anything of ours runs: other work skews every row
    if load > 0.5:
        print(f"bench spec: warning: load average {load:.1f} before starting; rows will be skewed", flush=True)
    model = bench_model(args)
    eagle, medusa = _heads(cfg, model)
    prompts = bench_prompts(args, AutoTokenizer.from_pretrained(model))
    modes = plan_modes(cfg, eagle, medusa)
    print(f"bench spec: {len(prompts)} prompts x {cfg.max_tokens} tokens, batches {cfg.batches}, {model}", flush=True)
    started = time.perf_counter()
    rows = measure(cfg, model, prompts, modes)
    report = build_report(cfg, model, len(prompts), modes, rows, time.perf_counter() - started, load)
    write_results(cfg.out, report)
    return 0


def _heads(cfg: SpecBenchConfig, model: Path) -> tuple[Path, Path]:
    """The configured heads; --reduced without them: tiny random ones in the public formats."""
    from tandem.models.eagle_io import random_eagle_checkpoint
    from tandem.models.medusa import random_medusa_checkpoint

    eagle = cfg.eagle_head or random_eagle_checkpoint(model.parent / "eagle", model, seed=1)
    medusa = cfg.medusa_head or random_medusa_checkpoint(model.parent / "medusa", model, num_heads=3, seed=1)
    return eagle, medusa


def measure(cfg: SpecBenchConfig, model: Path, prompts: list[list[int]], modes: list[Mode]) -> list[dict]:
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    in_process = [m for m in modes if not m.stack and not m.skipped]  # transformers rows (none in --mode shapes)
    generator = HFGenerator(model, cfg.dtype, cfg.max_tokens, cfg.devices.target) if in_process else None
    served = [m for m in modes if m.stack and not m.skipped]
    stacks = [m.stack for m in served]
    kv = bench_kv_cache_tokens(max(map(len, prompts)), cfg.max_tokens, max(cfg.batches))
    with running_stacks(model, cfg.dtype, cfg.threads, stacks, cfg.devices, kv) as addresses, \
            contextlib.ExitStack() as channels:
        runners = {}
        for m, address in zip(served, addresses):
            channel = channels.enter_context(open_channel(address))
            runners[m.name] = TandemRunner(generate_pb2_grpc.GenerationStub(channel), cfg.max_tokens)
        for m in in_process:
            runners[m.name] = HFRunner(generator, m.lookup_tokens)
        for runner in runners.values():  # warm-up: first calls load kernels and caches
            runner.run(prompts[:1], 0.0, [0])
        batches = sorted({min(b, len(prompts)) for b in cfg.batches})  # as many streams as prompts, at most
        return [row for t in cfg.temperatures for b in batches for row in measure_cell(runners, modes, prompts, t, b, cfg)]


def measure_cell(runners: dict, modes: list[Mode], prompts, temperature: float, batch: int,
                 cfg: SpecBenchConfig) -> list[dict]:
    """One (temperature, batch) cell: every mode over every prompt, taking turns group by group."""
    refused = {m.name: m.skipped for m in modes if m.skipped}
    tallies = {name: Tally() for name in runners}
    before = {name: r.counters() for name, r in runners.items()}
    starts = range(0, len(prompts), batch)
    for g, start in enumerate(starts):
        group, seeds = prompts[start : start + batch], [cfg.seed + start + j for j in range(batch)]
        names = list(runners)
        for name in names[g % len(names):] + names[: g % len(names)]:
            if name in refused:
                continue
            try:
                result, seconds = timed(runners[name], group, temperature, seeds[: len(group)])
            except Refused as e:
                refused[name] = str(e)
                continue
            tallies[name].add(result, seconds)
        print(f"  temperature {temperature:g}, batch {batch}: {min(start + batch, len(prompts))}/{len(prompts)}"
              " prompts", flush=True)
    after = {name: r.counters() for name, r in runners.items()}
    return [_row(m, temperature, batch, refused.get(m.name), tallies.get(m.name), before.get(m.name),
                 after.get(m.name), cfg) for m in modes]


def _row(mode: Mode, temperature: float, batch: int, refused: str | None, tally: Tally | None,
         before: dict | None, after: dict | None, cfg: SpecBenchConfig) -> dict:
    row = {"mode": mode.name, "label": mode.label, "temperature": temperature, "batch": batch, "how": mode.how}
    if refused:
        return {**row, "status": "skipped", "reason": refused}
    depth = max(cfg.spec_draft_length, len(tally.accepted_by_depth)) if mode.stack and mode.speculative else 0
    return {
        **row,
        "status": "ok",
        "seconds": round(tally.seconds, 6),
        "completion_tokens": tally.completion_tokens,
        "tokens_per_s": round(tally.completion_tokens / tally.seconds, 4),
        "mean_accepted_length": round(tally.mean_accepted_length(), 4),
        "verify_steps": tally.verify_steps,
        "accepted_draft_tokens": tally.accepted_draft_tokens,
        "requests": tally.requests,
        "looping_requests": tally.looping,
        # transformers reports no per-position acceptance for prompt lookup.
        "acceptance_by_depth": [round(a, 4) for a in tally.acceptance_by_depth(depth)] if depth else None,
        "time_split": time_split(before, after, tally.seconds) if before is not None else None,
    }
