"""The soak's requests and their judge: a seeded mix of greedy, sampled, seeded, n > 1, shared
prefixes, stop strings, logprobs, cancellations mid-stream, short deadlines and bad requests,
run many streams at once against `tandem up`; each outcome is checked against what that request
must give (greedy and seeded ones: their tokens when run alone)."""

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.v1 import generate_pb2 as pb

PREFIXES = ("You are a helpful assistant. ", "Answer in one word. ", "")
TOPICS = ("The quick brown fox", "Once upon a time", "def fibonacci(n):", "The capital of France is",
          "In 1969, the first", "Water boils at")
CLEAN_REFUSALS = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED"}


@dataclass
class SoakRequest:
    kind: str  # greedy, sampled, seeded, tree, stop, logprobs, cancel, deadline, bad
    request: pb.GenerateRequest
    timeout_s: float = 120.0
    cancel_after_first: bool = False
    expect: str = "OK"  # the status it must end with (OK: completed)


@dataclass
class Result:
    code: str
    tokens: dict[int, list[int]] = field(default_factory=dict)  # choice index -> its token ids
    finishes: dict[int, str] = field(default_factory=dict)
    logprobs: int = 0
    details: str = ""


def _params(rng: random.Random, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=rng.randint(8, 40), ignore_eos=True, **kw)


def make_requests(count: int, seed: int = 0) -> list[SoakRequest]:
    rng = random.Random(seed)
    kinds = ["greedy", "sampled", "seeded", "tree", "stop", "logprobs", "cancel", "deadline", "bad"]
    weights = [4, 2, 2, 2, 1, 1, 1, 1, 1]
    out = []
    for i in range(count):
        kind = rng.choices(kinds, weights)[0]
        prompt = rng.choice(PREFIXES) + rng.choice(TOPICS)  # shared prefixes: the prefix cache's work
        out.append(_make(kind, prompt, rng, f"soak-{i}"))
    return out


def _make(kind: str, prompt: str, rng: random.Random, request_id: str) -> SoakRequest:
    def req(params: pb.SamplingParams) -> pb.GenerateRequest:
        return pb.GenerateRequest(request_id=request_id, prompt=prompt, params=params)

    if kind == "greedy":
        return SoakRequest(kind, req(_params(rng, temperature=0)))
    if kind == "sampled":
        return SoakRequest(kind, req(_params(rng, temperature=0.9, top_p=0.95)))
    if kind == "seeded":
        return SoakRequest(kind, req(_params(rng, temperature=0.8, seed=rng.randint(1, 10**6))))
    if kind == "tree":
        return SoakRequest(kind, req(_params(rng, temperature=0.7, seed=rng.randint(1, 10**6), n=rng.randint(2, 4))))
    if kind == "stop":
        return SoakRequest(kind, req(_params(rng, temperature=0, stop=["e", "\n"])))
    if kind == "logprobs":
        return SoakRequest(kind, req(_params(rng, temperature=0, logprobs=True, top_logprobs=2)))
    if kind == "cancel":
        return SoakRequest(kind, req(pb.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)),
                           cancel_after_first=True, expect="CANCELLED")
    if kind == "deadline":  # over before a long generation ends
        return SoakRequest(kind, req(pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)),
                           timeout_s=0.3, expect="DEADLINE_EXCEEDED")
    bad = rng.choice([pb.SamplingParams(temperature=-1), pb.SamplingParams(top_p=2.0), pb.SamplingParams(n=0),
                      pb.SamplingParams(stop=[""]), pb.SamplingParams(max_tokens=10**7)])
    return SoakRequest(kind, req(bad), expect="INVALID_ARGUMENT")


def run_one(stub, item: SoakRequest) -> Result:
    result = Result("OK")
    call = stub.Generate(item.request, timeout=item.timeout_s)
    try:
        for response in call:
            for choice in response.choices:
                result.tokens.setdefault(choice.index, []).extend(choice.token_ids)
                result.logprobs += len(choice.logprobs)
                if choice.finish_reason:
                    result.finishes[choice.index] = choice.finish_reason
            if item.cancel_after_first:
                call.cancel()
    except grpc.RpcError as e:
        result.code, result.details = e.code().name, e.details() or ""
    return result


def deterministic(item: SoakRequest) -> bool:
    """Its tokens do not depend on the batch: greedy, or seeded (keyed draws)."""
    params = item.request.params
    return item.expect == "OK" and (params.temperature == 0 or params.HasField("seed"))


def judge(item: SoakRequest, result: Result, alone: Result | None) -> str:
    """'' if the outcome is right, else why not."""
    if result.code not in {"OK", *CLEAN_REFUSALS}:
        return f"{item.kind}: status {result.code} {result.details}"
    if item.expect == "DEADLINE_EXCEEDED" and result.code == "OK":
        return ""  # it finished first: allowed
    if result.code != item.expect:
        return f"{item.kind}: {result.code} ({result.details}), expected {item.expect}"
    if result.code != "OK":
        return ""
    n = item.request.params.n or 1
    if len(result.finishes) != n:
        return f"{item.kind}: {len(result.finishes)} of {n} choices finished"
    if item.kind == "logprobs" and result.logprobs != sum(len(t) for t in result.tokens.values()):
        return f"logprobs: {result.logprobs} for {sum(len(t) for t in result.tokens.values())} tokens"
    if alone is not None and result.tokens != alone.tokens:
        return f"{item.kind}: tokens differ from the request run alone"
    return ""


def run_all(stub, items: list[SoakRequest], streams: int, on_progress=None) -> list[Result]:
    """Runs `items` over `streams` threads; on_progress(done) after each."""
    results: list[Result | None] = [None] * len(items)
    lock = threading.Lock()
    cursor = iter(range(len(items)))
    done = [0]

    def worker():
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            results[i] = run_one(stub, items[i])
            with lock:
                done[0] += 1
                count = done[0]
            if on_progress:
                on_progress(count)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def settle(probe, timeout_s: float = 30.0):
    """probe() -> (ok, value) until ok or the timeout; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok, value = probe()
        if ok or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
