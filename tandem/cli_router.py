"""The router's command-line flags and its config from them; `tandem up` shares the flags and
passes each through (router_flag_options). Each flag falls back to its TANDEM_* variable."""

import argparse
from pathlib import Path

from tandem.envvars import env_default as _env
from tandem.security.cli_flags import public_tls_config, tls_config


def add_request_limit_flags(p: argparse.ArgumentParser) -> None:
    """One flag per size cap of a public request (router.limits.RequestLimits documents each)."""
    from dataclasses import fields

    from router.limits import RequestLimits

    for f in fields(RequestLimits):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=_env(f.name, f.default),
                       help=f"a request's {f.name.removeprefix('max_').replace('_', ' ')} at most"
                            " (INVALID_ARGUMENT naming the limit past it)")


def request_limits(args):
    from dataclasses import fields

    from router.limits import RequestLimits

    return RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)})


def add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk-size", type=int, default=_env("prefill_chunk_size", 512),
                   help="prompt tokens per step; longer prompts are prefilled in chunks")
    p.add_argument("--max-waiting", type=int, default=_env("max_waiting", 1024),
                   help="requests queued; more get RESOURCE_EXHAUSTED with a grpc-retry-pushback-ms trailer")
    p.add_argument("--max-running-requests", type=int, default=_env("max_running_requests", 0),
                   help="requests running at once; later ones wait (0: as the sequence budget allows)")
    p.add_argument("--max-concurrent-rpcs", type=int, default=_env("max_concurrent_rpcs", 0),
                   help="calls in flight on the public port; more get RESOURCE_EXHAUSTED (0: no cap)")
    p.add_argument("--max-connection-age-s", type=float, default=_env("max_connection_age_s", 1800.0),
                   help="public connections are closed after this long (clients reconnect, spreading over"
                        " replicas; 0: never)")
    p.add_argument("--max-connection-age-grace-s", type=float, default=_env("max_connection_age_grace_s", 900.0),
                   help="calls of an aged connection get this long to finish")
    p.add_argument("--min-ping-interval-s", type=float, default=_env("min_ping_interval_s", 10.0),
                   help="public clients pinging more often are disconnected (keepalive enforcement)")
    p.add_argument("--api-key-file", default=_env("api_key_file", None),
                   help="the public API requires 'authorization: Bearer <key>' with a key of this file (one a line;"
                        " re-read when it changes)")
    p.add_argument("--http-port", type=int, default=_env("http_port", 8000),
                   help="the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models,"
                        " /health) on this port, with the gRPC port's TLS and API keys (0: off; docs/openai.md)")
    p.add_argument("--served-model-name", default=_env("served_model_name", None),
                   help="the model name the HTTP API answers to (default: the name in the model's config.json,"
                        " else its folder's)")
    p.add_argument("--shutdown-grace-s", type=float, default=_env("shutdown_grace_s", 20.0),
                   help="on SIGTERM: health NOT_SERVING, new requests UNAVAILABLE, running ones get this long to"
                        " finish (then they end cancelled)")
    p.add_argument("--default-max-tokens", type=int, default=_env("default_max_tokens", 1024),
                   help="max_tokens of a request that leaves it unset (clipped to the context and the KV cache)")
    p.add_argument("--max-total-sequence-length", type=int, default=_env("max_total_sequence_length", 0),
                   help="tokens over all live sequences (0: the KV cache's size)")
    add_request_limit_flags(p)
    p.add_argument("--ngram-min-n", type=int, default=_env("ngram_min_n", 2),
                   help="--local-draft ngram: the shortest suffix looked up")
    p.add_argument("--ngram-max-n", type=int, default=_env("ngram_max_n", 4),
                   help="--local-draft ngram: the longest suffix looked up (the longest that occurred before wins)")
    p.add_argument("--suffix-depth", type=int, default=_env("suffix_depth", 6),
                   help="--local-draft suffix: the longest context whose followers are counted")
    p.add_argument("--suffix-cache-tokens", type=int, default=_env("suffix_cache_tokens", 65536),
                   help="--local-draft suffix: tokens of other requests' recent outputs it drafts from too")
    p.add_argument("--prefix-cache-max-num-recycling-seqs", type=int,
                   default=_env("prefix_cache_max_num_recycling_seqs", -1),
                   help="finished sequences the prefix cache keeps (-1: as slots allow, 0: off)")


def router_flag_options() -> list[tuple[str, str]]:
    """(--flag, dest) of every flag add_router_flags defines: `tandem up` passes each through."""
    p = argparse.ArgumentParser(add_help=False)
    add_router_flags(p)
    return [(action.option_strings[0], action.dest) for action in p._actions]


def router_config(args, model: Path):
    from router.config import RouterConfig

    return RouterConfig(
        model_dir=model,
        target_address=args.target,
        host=args.host,
        port=args.port,
        prefill_chunk_size=args.prefill_chunk_size,
        max_waiting=args.max_waiting,
        max_running_requests=args.max_running_requests,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_connection_age_s=args.max_connection_age_s,
        max_connection_age_grace_s=args.max_connection_age_grace_s,
        min_ping_interval_s=args.min_ping_interval_s,
        shutdown_grace_s=args.shutdown_grace_s,
        request_limits=request_limits(args),
        default_max_tokens=args.default_max_tokens,
        draft_address=args.draft or None,
        local_draft="" if getattr(args, "local_draft", "none") == "none" else args.local_draft,
        ngram_min_n=args.ngram_min_n,
        ngram_max_n=args.ngram_max_n,
        suffix_depth=args.suffix_depth,
        suffix_cache_tokens=args.suffix_cache_tokens,
        spec_draft_length=args.spec_draft_length,
        spec_disable_batch_size=args.spec_disable_batch_size,
        max_num_sequence=getattr(args, "router_max_num_sequence", 0),
        max_total_sequence_length=args.max_total_sequence_length,
        prefix_cache_max_num_recycling_seqs=args.prefix_cache_max_num_recycling_seqs,
        metrics_port=args.metrics_port,
        tls=tls_config(args),
        public_tls=public_tls_config(args),
        api_key_file=Path(args.api_key_file) if args.api_key_file else None,
        health_port=args.health_port,
        http_port=args.http_port,
        served_model_name=args.served_model_name or "",
    )
