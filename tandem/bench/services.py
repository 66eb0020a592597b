"""Runs target and router as real processes on free loopback ports, for benchmarks."""

import contextlib
import socket
import subprocess
import sys
from pathlib import Path

from tandem.launcher import wait_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_services(model: Path, dtype: str, threads: int = 0, extra_target: tuple[str, ...] = (),
                     extra_router: tuple[str, ...] = ()):
    """Yields the router's address; stops both processes afterwards."""
    tport, rport = free_port(), free_port()
    cli = [sys.executable, "-m", "tandem.cli"]
    procs = []
    try:
        target = [*cli, "--log-level", "WARNING", "target", "--model", str(model), "--dtype", dtype,
                  "--host", "127.0.0.1", "--port", str(tport), "--threads", str(threads), *extra_target]
        procs.append(subprocess.Popen(target))
        wait_healthy(f"127.0.0.1:{tport}", procs)
        router = [*cli, "--log-level", "WARNING", "router", "--model", str(model), "--dtype", dtype,
                  "--host", "127.0.0.1", "--port", str(rport), "--target", f"127.0.0.1:{tport}", *extra_router]
        procs.append(subprocess.Popen(router))
        wait_healthy(f"127.0.0.1:{rport}", procs)
        yield f"127.0.0.1:{rport}"
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
