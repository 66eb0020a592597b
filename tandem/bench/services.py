"""Runs target, draft and router as real processes on free loopback ports, for benchmarks."""

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tandem.launcher import wait_healthy


# Below Linux's ephemeral range (32768-60999): a port the kernel hands to bind(0) or to an
# outgoing connection (every gRPC channel on loopback takes one) could be taken between this
# check and the service's own bind; CI once lost a metrics port that way.
_RESERVED_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port that was free just now, outside the ephemeral range."""
    rng = random.Random()
    for _ in range(64):
        port = rng.choice(_RESERVED_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, slots=True)
class Devices:
    """Where the benchmark's models run: the target (and transformers' rows), and the draft (a
    second GPU, as compose.yaml places it); `eager` passes --enforce-eager to both services (no
    CUDA graphs), to measure what the graphs give."""

    target: str = "cpu"
    draft: str = "cpu"
    eager: bool = False

    @classmethod
    def from_args(cls, args) -> "Devices":
        return cls(args.device, args.draft_device or args.device, args.enforce_eager)

    def service_flags(self, device: str) -> list[str]:
        return ["--device", device, *(["--enforce-eager"] if self.eager else [])]

    def record(self, with_draft: bool = True) -> dict:
        """What the results file says; `with_draft` False for benches that start no draft. The
        services capture CUDA graphs only on CUDA devices, and not under --enforce-eager."""
        where = {"target": self.target, **({"draft": self.draft} if with_draft else {})}
        on_cuda = any(d.startswith("cuda") for d in where.values())
        return {**where, "cuda_graphs": on_cuda and not self.eager}


@dataclass(frozen=True, slots=True)
class StackSpec:
    """One target + router (+ draft) stack: extra flags for each process; `draft` None means
    plain decoding (no draft process)."""

    draft: tuple[str, ...] | None = None
    target: tuple[str, ...] = ()
    router: tuple[str, ...] = ()


@contextlib.contextmanager
def running_services(model: Path, dtype: str, threads: int = 0, extra_target: tuple[str, ...] = (),
                     extra_router: tuple[str, ...] = (), devices: Devices = Devices()):
    """Yields the router's address; stops the processes afterwards."""
    with running_stacks(model, dtype, threads, [StackSpec(None, extra_target, extra_router)], devices) as addresses:
        yield addresses[0]


def bench_kv_cache_tokens(longest_prompt: int, max_tokens: int, streams: int) -> int:
    """The KV cache a bench stack's target needs: each stream's prompt and answer, a step's drafts
    and a page of rounding beside them; at least 4096. The service default (32,768 tokens) is
    1.5 GB of fp32 KV per default-model target, and a spec bench runs a stack per row at once:
    six such stacks (3.1 GB a target) filled this 24 GB machine and starved it of page cache."""
    need = streams * (longest_prompt + max_tokens + 64 + 16)
    return max(4096, -(-need // 1024) * 1024)


@contextlib.contextmanager
def running_stacks(model: Path, dtype: str, threads: int, specs: list[StackSpec], devices: Devices = Devices(),
                   kv_cache_tokens: int = 0):
    """Starts every stack, each tier of processes in parallel (targets, then drafts, then
    routers: each needs the one before it), and yields the routers' addresses in order.
    kv_cache_tokens: each target's KV cache (0: the service's default)."""
    cli = [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING"]
    common = ["--model", str(model), "--dtype", dtype, "--host", "127.0.0.1"]
    kv = ["--kv-cache-tokens", str(kv_cache_tokens)] if kv_cache_tokens else []
    procs: list[subprocess.Popen] = []
    tports = [free_port() for _ in specs]
    try:
        _start_tier(procs, [
            (p, [*cli, "target", *common, "--port", str(p), "--threads", str(threads), *kv,
                 *devices.service_flags(devices.target), *s.target])
            for s, p in zip(specs, tports)
        ], one_at_a_time=devices.target == "cpu")
        dports = {i: free_port() for i, s in enumerate(specs) if s.draft is not None}
        _start_tier(procs, [
            (dports[i], [*cli, "draft", *common, "--port", str(dports[i]), "--threads", str(threads),
                         *devices.service_flags(devices.draft), "--target", f"127.0.0.1:{tports[i]}", *specs[i].draft])
            for i in dports
        ], one_at_a_time=devices.draft == "cpu")
        rports = [free_port() for _ in specs]
        _start_tier(procs, [
            (rp, [*cli, "router", *common, "--port", str(rp), "--target", f"127.0.0.1:{tp}",
                  *(["--draft", f"127.0.0.1:{dports[i]}"] if i in dports else []), *s.router])
            for i, (s, tp, rp) in enumerate(zip(specs, tports, rports))
        ])
        yield [f"127.0.0.1:{p}" for p in rports]
    finally:
        _stop(procs)


@contextlib.contextmanager
def running_target(model: Path, dtype: str, threads: int, devices: Devices = Devices(), tls=None):
    """A target process alone (serving `tls`, a TlsConfig, when given); yields its address."""
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", "target", "--model", str(model),
           "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
           *devices.service_flags(devices.target)]
    probe = port
    if tls is not None:  # readiness on its plaintext probe port: health alone answers there
        probe = free_port()
        cmd += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca),
                "--health-port", str(probe)]
    procs: list[subprocess.Popen] = []
    try:
        _start_tier(procs, [(probe, cmd)])
        yield f"127.0.0.1:{port}"
    finally:
        _stop(procs)


def _start_tier(procs: list[subprocess.Popen], tier: list[tuple[int, list[str]]], one_at_a_time: bool = False) -> None:
    """one_at_a_time: each process is healthy before the next starts. CPU services need it: each
    times its matmul kernels as it loads (tandem.models.linear), which others loading beside it
    would skew (in a bench of four stacks started together, plain decoding's target chose the
    kernel that made its step 70 ms instead of 53)."""
    # No Prometheus endpoints nor HTTP APIs (a router's --http-port, given, wins): several stacks
    # on one machine would collide on their fixed ports.
    env = {**os.environ, "TANDEM_METRICS_PORT": "0", "TANDEM_HTTP_PORT": "0"}
    for port, cmd in tier:
        with sigterm_held():
            procs.append(subprocess.Popen(cmd, env=env))
        if one_at_a_time:
            wait_healthy(f"127.0.0.1:{port}", procs)
    if not one_at_a_time:
        for port, _ in tier:
            wait_healthy(f"127.0.0.1:{port}", procs)


@contextlib.contextmanager
def sigterm_held():
    """Holds SIGTERM until the block ends, then delivers it to the handler it found: a SIGTERM
    that cmd_bench turns into SystemExit between a service's fork and its Popen's return would
    leave that process out of the list to stop. Blocking the signal instead would be inherited by
    the child through fork and exec, which could then not be terminated."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if held:
            os.kill(os.getpid(), signal.SIGTERM)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):  # routers first, so they stop sending steps
        p.terminate()
    for p in reversed(procs):
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
