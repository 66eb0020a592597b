"""`tandem bench --mode plain`: tandem's plain decoding against transformers' `generate`, side by
side in one run on MT-bench first turns, at batch 1 and with concurrent streams.

Both generate exactly --max-tokens greedy tokens per prompt, eos not stopping either, so the work
and (fp32) the outputs are the same. Results go to bench/results/ with the machine's facts.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.bench.hf import HFGenerator
from tandem.bench.inputs import bench_model, bench_prompts
from tandem.bench.machine import machine_facts, matvec_bandwidth
from tandem.bench.services import Devices, running_services
from tandem.bench.shapes import add_shapes_flag
from tandem.bench.spec_modes import add_spec_flags
from tandem.channels import open_channel
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc


def add_bench_flags(p) -> None:
    p.add_argument("--mode", choices=["plain", "prefix", "spec", "shapes", "rpc", "http", "structured"], default="plain",
                   help="plain: tandem vs transformers; prefix: the prefix cache on vs off;"
                        " spec: speculation modes side by side; shapes: EAGLE draft shapes vs plain;"
                        " rpc: a target step's cost beyond its compute, a call each vs the step stream;"
                        " http: the OpenAI HTTP API (server-sent events) vs gRPC streaming, per token;"
                        " structured: JSON-schema answers, plain vs EAGLE with unconstrained vs constrained drafts")
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--questions", type=int, default=80, help="prompts of the workload to use (MT-bench: of 80)")
    p.add_argument("--workload", choices=["mtbench", "code"], default="mtbench",
                   help="the prompts: MT-bench's first turns, or code edits of our own (16; tandem/bench/code_workload.py)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads for both (0: all cores)")
    p.add_argument("--device", default="cpu", help="torch device of the target and of transformers' rows (cuda:0, ...)")
    p.add_argument("--draft-device", default="", help="torch device of the draft (default: --device)")
    p.add_argument("--enforce-eager", action="store_true", help="the services run without CUDA graphs")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reduced", action="store_true", help="a tiny random model (and heads) and 4 prompts (for tests)")
    add_spec_flags(p)
    add_shapes_flag(p)


def _tandem_one(stub, ids: list[int], max_tokens: int) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = []
    for response in stub.Generate(pb.GenerateRequest(token_ids=ids, params=params), timeout=3600):
        out.extend(response.choices[0].token_ids)
    return out


def bench_side_by_side(args, model: Path, prompts) -> tuple[dict, dict, list, list]:
    """Alternates tandem and transformers group by group (a group: `concurrency` prompts, as
    concurrent streams for tandem, as one padded batch for transformers), so that drift in the
    machine's speed touches both alike."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    devices = Devices.from_args(args)
    generator = HFGenerator(model, args.dtype, args.max_tokens, devices.target)
    hf_generate = lambda batch: generator.generate(batch).outputs  # noqa: E731
    tandem, hf = {}, {}
    with running_services(model, args.dtype, args.threads, devices=devices) as address:
        with open_channel(address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            _tandem_one(stub, prompts[0], 4)  # warm-up
            hf_generate([prompts[0]])
            for c in (1, args.concurrency):
                groups = [prompts[i : i + c] for i in range(0, len(prompts), c)]
                t_sec, h_sec, t_out, h_out = 0.0, 0.0, [], []
                for group in groups:
                    started = time.perf_counter()
                    with ThreadPoolExecutor(len(group)) as pool:
                        t_out += list(pool.map(lambda ids: _tandem_one(stub, ids, args.max_tokens), group))
                    t_sec += time.perf_counter() - started
                    started = time.perf_counter()
                    h_out += hf_generate(group)
                    h_sec += time.perf_counter() - started
                    print(f"  x{c}: {len(t_out)}/{len(prompts)} prompts", flush=True)
                tandem[c], hf[c] = _figures(t_sec, t_out), _figures(h_sec, h_out)
                if c == 1:
                    outputs = (t_out, h_out)
            tandem["overhead"] = _overhead(stub)
    return tandem, hf, *outputs


def _overhead(stub) -> dict:
    s = stub.Stats(pb.StatsRequest(), timeout=10)
    steps = max(s.steps_total, 1)
    return {
        "steps": s.steps_total,
        "mean_step_ms": round(s.step_ms_total / steps, 3),
        "mean_target_compute_ms": round(s.target_compute_ms_total / steps, 3),
        "rpc_overhead_fraction": round(1 - s.target_compute_ms_total / max(s.step_ms_total, 1e-9), 4),
    }


def _figures(seconds: float, outputs: list[list[int]]) -> dict:
    tokens = sum(map(len, outputs))
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 2)}


def run_bench(args) -> int:
    from transformers import AutoTokenizer

    model = bench_model(args)
    prompts = bench_prompts(args, AutoTokenizer.from_pretrained(model))
    print(f"bench plain: {len(prompts)} prompts x {args.max_tokens} tokens, {model}", flush=True)
    tandem, hf, tandem_outputs, hf_outputs = bench_side_by_side(args, model, prompts)
    report = _report(args, model, tandem, hf, tandem_outputs, hf_outputs)
    _write(Path(args.out), report)
    print(json.dumps(report["summary"], indent=2))
    return 0


def _report(args, model: Path, tandem: dict, hf: dict, tandem_outputs: list, hf_outputs: list) -> dict:
    from tandem.bench.machine import decode_weight_bytes

    c = args.concurrency
    weight_bytes = decode_weight_bytes(model, args.dtype)
    bandwidth = matvec_bandwidth(args.dtype, args.threads, args.device)
    bound_tps = bandwidth / weight_bytes  # one full read of the weights per decode step
    # transformers may stop early at eos even with eos_token_id unset: compare what both produced.
    same = sum(a[: len(b)] == b[: len(a)] for a, b in zip(tandem_outputs, hf_outputs))
    summary = {
        "tandem_tok_s_batch1": tandem[1]["tokens_per_s"],
        "transformers_tok_s_batch1": hf[1]["tokens_per_s"],
        "ratio_batch1": round(tandem[1]["tokens_per_s"] / hf[1]["tokens_per_s"], 3),
        f"tandem_tok_s_x{c}": tandem[c]["tokens_per_s"],
        f"transformers_tok_s_x{c}": hf[c]["tokens_per_s"],
        f"ratio_x{c}": round(tandem[c]["tokens_per_s"] / hf[c]["tokens_per_s"], 3),
        "bandwidth_bound_tok_s_batch1": round(bound_tps, 2),
        "tandem_fraction_of_bound_batch1": round(tandem[1]["tokens_per_s"] / bound_tps, 3),
        "greedy_outputs_identical_over_common_length": f"{same}/{len(hf_outputs)}",
        "rpc_overhead_fraction": tandem["overhead"]["rpc_overhead_fraction"],
    }
    return {
        "mode": "plain",
        "model": str(model),
        "dtype": args.dtype,
        "prompts": len(hf_outputs),
        "max_tokens": args.max_tokens,
        "concurrency": c,
        "reduced": args.reduced,
        "devices": Devices.from_args(args).record(with_draft=False),
        "machine": machine_facts(args.threads),
        "weight_bytes_per_step": weight_bytes,
        "matvec_bandwidth_bytes_s": bandwidth,
        "tandem": tandem,
        "transformers": hf,
        "summary": summary,
    }


def _write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tag = "reduced-" if report["reduced"] else ""
    (out / f"plain-{tag}{stamp}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / f"plain-{tag}latest.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"results written to {out}/plain-{tag}{stamp}.json")
