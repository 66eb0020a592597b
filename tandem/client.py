"""Client commands: `tandem generate` streams a completion, `tandem health` checks a service."""

import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.grpc_server import CHANNEL_OPTIONS
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


def generate(args) -> int:
    with grpc.insecure_channel(args.address, options=CHANNEL_OPTIONS) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        started = time.perf_counter()
        first = None
        usage = None
        texts: dict[int, list[str]] = {}  # n > 1: each choice is printed whole at the end
        try:
            for response in stub.Generate(build_request(args), timeout=600):
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
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
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


def health(address: str, service: str = "", timeout: float = 3.0, quiet: bool = False) -> int:
    """0 when SERVING, 1 otherwise (for compose healthchecks)."""
    with grpc.insecure_channel(address) as channel:
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
