"""Helpers of the fault tests: `tandem up` (or one service) as real processes on loopback, the
services' pids from its output, greedy streams from threads, probes of health and stats.

Run as a module it is a client for a router in another network namespace (tests/e2e/test_netns.py):
`python -m tests.e2e.faults load ADDRESS MAX_TOKENS PROMPT...` prints "streaming" once every
stream has its first tokens, then one JSON line of outcomes; `... stats ADDRESS` prints the
router's Stats as JSON.
"""

import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from tandem.bench.services import free_port
from tandem.client import health
from tandem.grpc_server import CHANNEL_OPTIONS
from tandem.v1 import engine_pb2, engine_pb2_grpc, generate_pb2 as pb, generate_pb2_grpc
from tests import reliability

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("The quick brown fox", "Once upon a time, there was", "What is the capital of France?", "def fibonacci(n):")


def greedy(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def wait_for(condition, timeout_s: float = 60, what: str = "a condition", step_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(step_s)


def serving(address: str) -> bool:
    return health(address, timeout=1.0, quiet=True) == 0


class Up:
    """`tandem up` on a model as a real process tree; its output is read on a thread (the
    services log to it too: an unread pipe would block them)."""

    def __init__(self, model: Path, *flags: str):
        self.ports = {name: free_port() for name in ("router", "target", "draft")}
        metrics = [f for name in self.ports for f in (f"--{name}-metrics-port", str(free_port()))]
        ports = [f for name, port in self.ports.items() for f in (f"--{name}-port", str(port))]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", "--model", str(model), *ports, *metrics, *flags],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.channel = grpc.insecure_channel(self.address("router"), options=CHANNEL_OPTIONS)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout_s: float = 120) -> None:
        wait_for(lambda: self.proc.poll() is not None or any(" router on " in line for line in self.lines),
                 timeout_s, "tandem up to be ready")
        assert self.proc.poll() is None, self.output()[-3000:]

    def pid(self, name: str) -> int:
        """The service's latest pid, as `tandem up` printed it."""
        pattern = re.compile(rf"tandem up: {name} (?:re)?started \(pid (\d+)\)")
        pids = [int(m.group(1)) for line in self.lines if (m := pattern.search(line))]
        assert pids, f"no pid of {name} in:\n{self.output()[-3000:]}"
        return pids[-1]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        pid = self.pid(name)
        subprocess.run(["kill", f"-{sig}", str(pid)], check=True)
        return pid

    def wait_line(self, text: str, timeout_s: float = 60) -> None:
        wait_for(lambda: any(text in line for line in self.lines), timeout_s, f"'{text}' from tandem up")

    def router_stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=10)

    def engine_stats(self, name: str) -> engine_pb2.EngineStats:
        """The target's or the draft's own view of its KV pages and sequences."""
        with grpc.insecure_channel(self.address(name)) as channel:
            stub = (engine_pb2_grpc.TargetEngineStub if name == "target" else engine_pb2_grpc.DraftEngineStub)(channel)
            return stub.Stats(engine_pb2.EngineStatsRequest(), timeout=10)

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C would: every service stops with it; returns its exit code."""
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@dataclass
class Outcome:
    """One stream's end: its tokens, finish reason (of the last choice delta), status code name
    ("OK" when it completed), and when it ended (time.monotonic())."""

    tokens: list[int]
    finish: str
    code: str
    ended: float
    draft_tokens: int = 0
    details: str = ""  # the status's message, for a failure's diagnosis


def stream(stub, prompt: str, params: pb.SamplingParams, first: threading.Event | None = None,
           timeout_s: float = 120) -> Outcome:
    tokens, finish, draft_tokens = [], "", 0
    try:
        for response in stub.Generate(pb.GenerateRequest(prompt=prompt, params=params), timeout=timeout_s):
            for choice in response.choices:
                tokens.extend(choice.token_ids)
                finish = choice.finish_reason or finish
            draft_tokens = response.usage.draft_tokens or draft_tokens
            if first is not None:
                first.set()
    except grpc.RpcError as e:
        return Outcome(tokens, finish, e.code().name, time.monotonic(), draft_tokens, e.details() or "")
    reliability.served()  # in this process's summary (not the netns client's: its test counts those)
    return Outcome(tokens, finish, "OK", time.monotonic(), draft_tokens)


class Load:
    """Greedy streams of `prompts` started together, one thread each."""

    def __init__(self, stub, prompts, max_tokens: int, timeout_s: float = 120):
        self.firsts = [threading.Event() for _ in prompts]
        self._pool = ThreadPoolExecutor(len(prompts))
        self.futures: list[Future] = [self._pool.submit(stream, stub, p, greedy(max_tokens), e, timeout_s)
                                      for p, e in zip(prompts, self.firsts)]

    def wait_streaming(self, timeout_s: float = 60) -> None:
        """Every stream has its first tokens, and none has ended: the load runs."""
        wait_for(lambda: all(e.is_set() for e in self.firsts), timeout_s, "every stream's first tokens")
        assert not any(f.done() for f in self.futures), "a stream ended before the fault: make it longer"

    def outcomes(self, timeout_s: float = 120) -> list[Outcome]:
        try:
            return [f.result(timeout=timeout_s) for f in self.futures]
        finally:
            self._pool.shutdown(wait=False)


def main(argv: list[str]) -> None:
    command, address = argv[0], argv[1]
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = generate_pb2_grpc.GenerationStub(channel)
    if command == "stats":
        print(json.dumps(MessageToDict(stub.Stats(pb.StatsRequest(), timeout=10))))
        return
    load = Load(stub, argv[3:], int(argv[2]), timeout_s=180)
    load.wait_streaming()
    print("streaming", flush=True)
    print(json.dumps([asdict(o) for o in load.outcomes(timeout_s=180)]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
