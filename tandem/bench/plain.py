"""`tandem bench --mode plain`: tandem's plain decoding against transformers' `generate`, side by
side in one run on MT-bench first turns, at batch 1 and with concurrent streams.

Both generate exactly --max-tokens greedy tokens per prompt (tandem: ignore_eos; transformers:
min_new_tokens), so the work is the same. Results go to bench/results/ with the machine's facts.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from tandem.bench.machine import machine_facts, matvec_bandwidth
from tandem.bench.services import running_services
from tandem.grpc_server import CHANNEL_OPTIONS
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc


def add_bench_flags(p) -> None:
    p.add_argument("--mode", choices=["plain"], default="plain")
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--questions", type=int, default=80, help="MT-bench first turns to use (of 80)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads for both (0: all cores)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reduced", action="store_true", help="a tiny random model and 4 prompts (for tests)")


def _prompts(args, tokenizer) -> list[list[int]]:
    if args.reduced:
        from tandem.testing.tiny import TINY_PROMPTS

        texts = list(TINY_PROMPTS[:4])
    else:
        from tandem.bench.data import mtbench_first_turns
        from tandem.models.fetch import tandem_home

        texts = mtbench_first_turns(tandem_home())[: args.questions]
    chats = [[{"role": "user", "content": t}] for t in texts]
    rendered = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered]


def _tandem_one(stub, ids: list[int], max_tokens: int) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = []
    for response in stub.Generate(pb.GenerateRequest(token_ids=ids, params=params), timeout=3600):
        out.extend(response.choices[0].token_ids)
    return out


def _timed(fn, prompts: list[list[int]], concurrency: int) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    if concurrency == 1:
        outputs = [fn(p) for p in prompts]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            outputs = list(pool.map(fn, prompts))
    return time.perf_counter() - started, outputs


def bench_tandem(args, model: Path, prompts) -> dict:
    with running_services(model, args.dtype, args.threads) as address:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            _tandem_one(stub, prompts[0], 4)  # warm-up
            one = lambda ids: _tandem_one(stub, ids, args.max_tokens)  # noqa: E731
            results = {}
            for concurrency in (1, args.concurrency):
                seconds, outputs = _timed(one, prompts, concurrency)
                results[concurrency] = _figures(seconds, outputs)
            results["outputs"] = outputs
            return results


def bench_transformers(args, model: Path, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype)).eval()
    n = args.max_tokens

    def generate(batch: list[list[int]]) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[:, width:].tolist()

    generate([prompts[0]])  # warm-up
    results = {}
    seconds, outputs = _timed(lambda p: generate([p])[0], prompts, 1)
    results[1] = _figures(seconds, outputs)
    results["outputs"] = outputs
    started = time.perf_counter()
    batched = [o for i in range(0, len(prompts), args.concurrency) for o in generate(prompts[i : i + args.concurrency])]
    results[args.concurrency] = _figures(time.perf_counter() - started, batched)
    return results


def _figures(seconds: float, outputs: list[list[int]]) -> dict:
    tokens = sum(map(len, outputs))
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 2)}


def run_bench(args) -> int:
    from transformers import AutoTokenizer

    model = _model(args)
    prompts = _prompts(args, AutoTokenizer.from_pretrained(model))
    print(f"bench plain: {len(prompts)} prompts x {args.max_tokens} tokens, {model}", flush=True)
    tandem = bench_tandem(args, model, prompts)
    print(f"tandem: {tandem[1]} / x{args.concurrency}: {tandem[args.concurrency]}", flush=True)
    hf = bench_transformers(args, model, prompts)
    print(f"transformers: {hf[1]} / x{args.concurrency}: {hf[args.concurrency]}", flush=True)
    report = _report(args, model, tandem, hf)
    _write(Path(args.out), report)
    print(json.dumps(report["summary"], indent=2))
    return 0


def _model(args) -> Path:
    if args.reduced:
        import tempfile

        from tandem.testing.tiny import build_tiny_model

        return build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    if args.model:
        return Path(args.model)
    from tandem.models.fetch import fetch_default_model, tandem_home

    return fetch_default_model(tandem_home())[args.dtype]


def _report(args, model: Path, tandem: dict, hf: dict) -> dict:
    from tandem.bench.machine import decode_weight_bytes

    c = args.concurrency
    weight_bytes = decode_weight_bytes(model, args.dtype)
    bandwidth = matvec_bandwidth(args.dtype, args.threads)
    bound_tps = bandwidth / weight_bytes  # one full read of the weights per decode step
    same = sum(a == b for a, b in zip(tandem["outputs"], hf["outputs"]))
    summary = {
        "tandem_tok_s_batch1": tandem[1]["tokens_per_s"],
        "transformers_tok_s_batch1": hf[1]["tokens_per_s"],
        "ratio_batch1": round(tandem[1]["tokens_per_s"] / hf[1]["tokens_per_s"], 3),
        f"tandem_tok_s_x{c}": tandem[c]["tokens_per_s"],
        f"transformers_tok_s_x{c}": hf[c]["tokens_per_s"],
        f"ratio_x{c}": round(tandem[c]["tokens_per_s"] / hf[c]["tokens_per_s"], 3),
        "bandwidth_bound_tok_s_batch1": round(bound_tps, 2),
        "tandem_fraction_of_bound_batch1": round(tandem[1]["tokens_per_s"] / bound_tps, 3),
        "greedy_outputs_identical": f"{same}/{len(hf['outputs'])}",
    }
    return {
        "mode": "plain",
        "model": str(model),
        "dtype": args.dtype,
        "prompts": len(hf["outputs"]),
        "max_tokens": args.max_tokens,
        "concurrency": c,
        "reduced": args.reduced,
        "machine": machine_facts(args.threads),
        "weight_bytes_per_step": weight_bytes,
        "matvec_bandwidth_bytes_s": bandwidth,
        "tandem": {k: v for k, v in tandem.items() if k != "outputs"},
        "transformers": {k: v for k, v in hf.items() if k != "outputs"},
        "summary": summary,
    }


def _write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tag = "reduced-" if report["reduced"] else ""
    (out / f"plain-{tag}{stamp}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / f"plain-{tag}latest.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"results written to {out}/plain-{tag}{stamp}.json")
