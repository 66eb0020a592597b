"""`tandem bench --mode structured`: structured output (JSON schemas) with and without speculation,
side by side in one run: (a) plain decoding, (b) EAGLE with unconstrained drafts (the draft's
--no-constrained-drafts), (c) EAGLE with constrained drafts and forced tokens (the default).

The workload is tandem/bench/json_workload.py's extraction and tool-call prompts, each with its
schema, as chat requests, greedy, one stream; each answer runs to its end (the grammar's stop)
or --max-tokens. The three stacks take turns prompt by prompt in a rotating order, so that drift
in the machine's speed touches all alike. Reported per mode: tokens/s, mean accepted length
(tokens per verify step, the bonus included), draft tokens and accepted ones, answers that parse
and validate, and whether the three modes' answers are the same (greedy: they must be).
"""

import argparse
import json
import time
from pathlib import Path

from tandem.bench.inputs import bench_model
from tandem.bench.json_workload import TASKS, JsonTask
from tandem.bench.machine import machine_facts, write_report
from tandem.bench.services import Devices, StackSpec, bench_kv_cache_tokens, running_stacks
from tandem.channels import open_channel
from tandem.models.heads import EAGLE_HEAD, device_shape_flags
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc

MODES = ("plain", "eagle_unconstrained", "eagle_constrained")


def _stacks(args, head: Path) -> dict[str, StackSpec]:
    router = ("--spec-draft-length", str(args.spec_draft_length), "--spec-disable-batch-size", str(args.spec_disable_batch_size))
    draft = ("--method", "eagle", "--draft-model", str(head), "--shape", "tree", "--tree-top-k", str(args.tree_top_k),
             "--tree-node-budget", str(args.tree_node_budget))
    return {"plain": StackSpec(router=router),
            "eagle_unconstrained": StackSpec(draft=(*draft, "--no-constrained-drafts"), router=router),
            "eagle_constrained": StackSpec(draft=draft, router=router)}


def _ask(stub, task: JsonTask, max_tokens: int) -> dict:
    so = pb.StructuredOutput(json_schema=json.dumps(task.schema))
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, structured_output=so)
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=task.prompt)], params=params)
    started, text, ids, usage, finish = time.perf_counter(), "", [], None, ""
    for response in stub.Generate(request, timeout=3600):
        for c in response.choices:
            text, ids, finish = text + c.text, ids + list(c.token_ids), c.finish_reason or finish
        if response.HasField("usage"):
            usage = response.usage
    return {"seconds": time.perf_counter() - started, "text": text, "ids": ids, "finish": finish,
            "completion_tokens": usage.completion_tokens, "verify_steps": usage.verify_steps,
            "draft_tokens": usage.draft_tokens, "accepted_draft_tokens": usage.accepted_draft_tokens}


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_structured_bench(args) -> int:
    args = argparse.Namespace(**{**vars(args), **device_shape_flags(args)})
    model = bench_model(args)
    head = Path(args.eagle_head) if args.eagle_head else EAGLE_HEAD
    if args.reduced:
        from tandem.models.eagle_io import random_eagle_checkpoint

        head = Path(args.eagle_head) if args.eagle_head else random_eagle_checkpoint(model.parent / "eagle", model, seed=1)
    tasks = TASKS[: min(args.questions, 4 if args.reduced else len(TASKS))]
    stacks = _stacks(args, head)
    devices = Devices.from_args(args)
    kv = bench_kv_cache_tokens(512, args.max_tokens, 1)
    print(f"bench structured: {len(tasks)} prompts, greedy, one stream, up to {args.max_tokens} tokens; {model}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with running_stacks(model, args.dtype, args.threads, list(stacks.values()), devices, kv) as addresses:
        with open_channel(addresses[0]) as a, open_channel(addresses[1]) as b, open_channel(addresses[2]) as c:
            stubs = dict(zip(MODES, (generate_pb2_grpc.GenerationStub(ch) for ch in (a, b, c))))
            for stub in stubs.values():  # warm-up: kernels, the grammar backends, the first compile
                _ask(stub, tasks[0], 16)
            for i, task in enumerate(tasks):
                for mode in MODES[i % 3:] + MODES[: i % 3]:
                    runs[mode].append({**_ask(stubs[mode], task, args.max_tokens), "valid": None})
                    runs[mode][-1]["valid"] = _valid(runs[mode][-1]["text"], task.schema)
                print(f"  {i + 1}/{len(tasks)} prompts", flush=True)
    report = _report(args, model, head, tasks, runs, devices)
    return write_report(report, args.out, "structured", args.reduced, report["summary"])


def _side(runs: list[dict]) -> dict:
    seconds, tokens = sum(r["seconds"] for r in runs), sum(r["completion_tokens"] for r in runs)
    verify, accepted = sum(r["verify_steps"] for r in runs), sum(r["accepted_draft_tokens"] for r in runs)
    return {
        "requests": len(runs), "seconds": round(seconds, 4), "completion_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 3),
        "mean_accepted_length": round((accepted + verify) / verify, 4) if verify else 1.0,
        "verify_steps": verify, "draft_tokens": sum(r["draft_tokens"] for r in runs), "accepted_draft_tokens": accepted,
        "valid_json": sum(bool(r["valid"]) for r in runs), "finished_stop": sum(r["finish"] == "stop" for r in runs),
    }


def _report(args, model: Path, head: Path, tasks, runs: dict, devices: Devices) -> dict:
    sides = {m: _side(runs[m]) for m in MODES}
    tps = {m: sides[m]["tokens_per_s"] for m in MODES}
    same = sum(runs["plain"][i]["ids"] == runs[m][i]["ids"] for m in MODES[1:] for i in range(len(tasks)))
    return {
        "mode": "structured",
        "command": f"tandem bench --mode structured --questions {args.questions} --max-tokens {args.max_tokens}"
                   f" --threads {args.threads}" + (" --reduced" if args.reduced else ""),
        "model": str(model), "eagle_head": str(head), "dtype": args.dtype,
        "shape": {"tree_depth": args.spec_draft_length, "tree_top_k": args.tree_top_k, "tree_node_budget": args.tree_node_budget},
        "workload": {"extraction": sum(t.kind == "extraction" for t in tasks), "tool_call": sum(t.kind == "tool_call" for t in tasks),
                     "source": "tandem/bench/json_workload.py"},
        "modes": sides,
        "per_request": {m: [{k: r[k] for k in ("seconds", "completion_tokens", "verify_steps", "accepted_draft_tokens",
                                               "finish", "valid", "text")} for r in runs[m]] for m in MODES},
        "summary": {
            "tokens_per_s": tps,
            "mean_accepted_length": {m: sides[m]["mean_accepted_length"] for m in MODES},
            "constrained_over_unconstrained": round(tps["eagle_constrained"] / tps["eagle_unconstrained"], 4),
            "constrained_over_plain": round(tps["eagle_constrained"] / tps["plain"], 4),
            "unconstrained_over_plain": round(tps["eagle_unconstrained"] / tps["plain"], 4),
            "aim_constrained_faster_than_unconstrained": tps["eagle_constrained"] > tps["eagle_unconstrained"],
            "aim_eagle_structured_1_3x_plain": tps["eagle_constrained"] >= 1.3 * tps["plain"],
            "greedy_outputs_identical_to_plain": f"{same}/{2 * len(tasks)}",
        },
        "devices": devices.record(),
        "machine": machine_facts(args.threads),
    }
