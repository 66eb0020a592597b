"""Client commands: `tandem generate` streams a completion, `tandem health` checks a service."""

import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.channels import open_channel
from tandem.security.tls import PLAINTEXT, TlsConfig
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc


def build_request(args) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, stop=args.stop)
    if args.seed is not None:
        params.seed = args.seed
    if args.n != 1:
        params.n = args.n
    if args.raw:
        return pb.GenerateRequest(prompt=args.text, params=params)
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=args.text)], params=params)


def client_tls(args) -> TlsConfig:
    """--tls-ca / --tls-cert / --tls-key, each falling back to --tls-dir's ca.pem, client.pem and
    client-key.pem (what `tandem certs create` writes)."""
    folder = Path(args.tls_dir) if getattr(args, "tls_dir", None) else None

    def pick(given, name: str) -> Path | None:
        if given:
            return Path(given)
        return folder / name if folder and (folder / name).is_file() else None

    cert, key = pick(args.tls_cert, "client.pem"), pick(args.tls_key, "client-key.pem")
    return TlsConfig(cert if key else None, key if cert else None, pick(args.tls_ca, "ca.pem"))


def call_metadata(args) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {args.api_key}"),) if getattr(args, "api_key", None) else ()


def generate(args) -> int:
    metadata = call_metadata(args)
    with open_channel(args.address, client_tls(args), retry=True) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        started = time.perf_counter()
        first = None
        usage = None
        texts: dict[int, list[str]] = {}  # n > 1: each choice is printed whole at the end
        try:
            for response in stub.Generate(build_request(args), timeout=600, metadata=metadata):
                first = first or time.perf_counter()
                for choice in response.choices:
                    texts.setdefault(choice.index, []).append(choice.text)
                    if args.n == 1:
                        sys.stdout.write(choice.text)
                        sys.stdout.flush()
                if response.HasField("usage"):
                    usage = response.usage
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        elapsed = time.perf_counter() - started
        for index in sorted(texts) if args.n > 1 else ():
            print(f"[{index}] {''.join(texts[index])}")
        print()
        stats = stub.Stats(pb.StatsRequest(), timeout=10, metadata=metadata)
    _print_figures(usage, stats, elapsed, (first or started) - started)
    return 0


def _print_figures(usage, stats, elapsed: float, ttft: float) -> None:
    tokens = usage.completion_tokens if usage else 0
    print(
        f"--\nprompt {usage.prompt_tokens} tokens, completion {tokens} tokens in {elapsed:.2f} s"
        f" ({tokens / max(elapsed, 1e-9):.1f} tok/s, first token {ttft * 1e3:.0f} ms;"
        f" {usage.cached_prompt_tokens} prompt tokens from the prefix cache)",
        file=sys.stderr,
    )
    if stats.speculation_active:
        by_pos = ", ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
        print(
            f"speculation: {usage.draft_tokens} drafted, {usage.accepted_draft_tokens} accepted;"
            f" mean accepted length {stats.mean_accepted_length:.2f}; by position [{by_pos}]",
            file=sys.stderr,
        )
    else:
        print("speculation: off (plain decoding; 1 token per target step)", file=sys.stderr)


def health(address: str, service: str = "", timeout: float = 3.0, quiet: bool = False, tls: TlsConfig = PLAINTEXT) -> int:
    """0 when SERVING, 1 otherwise (for compose healthchecks). Health is open to any caller; a
    port with mutual TLS still wants a certificate its CA signed for the handshake."""
    with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
        except grpc.RpcError as e:
            if not quiet:
                print(f"{address}: {e.code().name}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    if not quiet:
        print(f"{address}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1
