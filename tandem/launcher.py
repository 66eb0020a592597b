"""`tandem up`: the services as local processes, stopped together on Ctrl-C or SIGTERM."""

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem.client import health
from tandem.models.heads import default_draft, default_shape, device_shape_flags, shipped_head

READY_TIMEOUT_S = 300.0


def _spawn(args: list[str], log_level: str, log_format: str = "text") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", "--log-level", log_level, "--log-format", log_format, *args])


def wait_healthy(address: str, procs: list[subprocess.Popen], timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a service exited before {address} was ready")
        if health(address, timeout=1.0, quiet=True) == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{address} not SERVING after {timeout:.0f} s")


def resolve_up_draft(args) -> argparse.Namespace:
    """--draft auto, an unnamed head and an unset shape made concrete (tandem.models.heads): on
    the default model a draft method without --draft-model takes the shipped head, and EAGLE
    without --shape the device's shape; unset --spec-draft-length, --tree-top-k,
    --tree-node-budget (Medusa's too: the nodes it keeps of its tree) and
    --spec-disable-batch-size take the device's."""
    shape = default_shape(args.device)
    draft = default_draft(args.model is not None) if args.draft == "auto" else args.draft
    chosen = {"draft": draft}
    if draft != "none" and args.draft_model is None and args.model is None:
        chosen["draft_model"] = shipped_head(draft)
    if draft == "eagle" and args.shape is None:
        chosen["shape"] = shape.shape
    chosen.update(device_shape_flags(args))
    return argparse.Namespace(**{**vars(args), **chosen})


def service_args(args, model: Path) -> tuple[list[str], list[str], list[str] | None]:
    common = ["--model", str(model), "--dtype", args.dtype]
    target = [
        "target", *common,
        "--host", args.host, "--port", str(args.target_port),
        "--device", args.device,
        "--kv-page-size", str(args.kv_page_size),
        "--kv-cache-tokens", str(args.kv_cache_tokens),
        "--max-num-sequence", str(args.max_num_sequence),
        "--max-context-length", str(args.max_context_length),
        "--threads", str(args.threads),
        "--metrics-port", str(args.target_metrics_port),
    ]
    router = [
        "router", *common,
        "--host", args.host, "--port", str(args.router_port),
        "--target", f"{args.host}:{args.target_port}",
        "--prefill-chunk-size", str(args.prefill_chunk_size),
        "--max-waiting", str(args.max_waiting),
        "--default-max-tokens", str(args.default_max_tokens),
        "--max-total-sequence-length", str(args.max_total_sequence_length),
        "--prefix-cache-max-num-recycling-seqs", str(args.prefix_cache_max_num_recycling_seqs),
        "--spec-draft-length", str(args.spec_draft_length),
        "--spec-disable-batch-size", str(args.spec_disable_batch_size),
        "--metrics-port", str(args.router_metrics_port),
    ]
    draft = None
    if args.draft != "none":
        if not args.draft_model:
            raise SystemExit(f"tandem up --draft {args.draft}: --draft-model DIR is required")
        draft = [
            "draft", *common, "--method", args.draft, "--draft-model", str(args.draft_model),
            "--host", args.host, "--port", str(args.draft_port), "--device", args.device,
            "--target", f"{args.host}:{args.target_port}", "--threads", str(args.threads),
            "--kv-page-size", str(args.kv_page_size), "--kv-cache-tokens", str(args.kv_cache_tokens),
            "--max-num-sequence", str(args.max_num_sequence),
            "--tree-top-k", str(args.tree_top_k), "--tree-node-budget", str(args.tree_node_budget),
            "--proposal-top-k", str(args.proposal_top_k), "--medusa-choices", args.medusa_choices,
            "--draft-lm-head-quant", args.draft_lm_head_quant, "--draft-head-quant", args.draft_head_quant,
            "--metrics-port", str(args.draft_metrics_port),
        ]
        if args.shape:
            draft += ["--shape", args.shape]
        router += ["--draft", f"{args.host}:{args.draft_port}"]
    if args.enforce_eager:
        target.append("--enforce-eager")
        draft = draft and [*draft, "--enforce-eager"]
    return target, router, draft


def run_up(args, model: Path) -> int:
    target_args, router_args, draft_args = service_args(args, model)
    procs: list[subprocess.Popen] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        procs.append(_spawn(target_args, args.log_level, args.log_format))
        wait_healthy(f"{args.host}:{args.target_port}", procs)
        if draft_args:
            procs.append(_spawn(draft_args, args.log_level, args.log_format))
            wait_healthy(f"{args.host}:{args.draft_port}", procs)
        procs.append(_spawn(router_args, args.log_level, args.log_format))
        wait_healthy(f"{args.host}:{args.router_port}", procs)
        drafting = f"{args.draft} {args.draft_model}, {args.shape or 'its default shape'}, k = {args.spec_draft_length}" \
            if draft_args else "none"
        print(f"tandem up: router on {args.host}:{args.router_port} (draft: {drafting})", flush=True)
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
    finally:
        _terminate(procs)
    return 0 if stopping else 1


def _terminate(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):  # the router first, so it stops sending steps
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in reversed(procs):
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
