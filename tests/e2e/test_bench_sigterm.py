"""`tandem bench` ended by SIGTERM (a `kill`, a CI job's timeout) stops the service processes it
started instead of leaving them running, and exits with 128 + SIGTERM."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.conftest import ROOT


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name, or None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and int(fields[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _started_service(pid: int) -> bool:
    """A `tandem.cli target|draft|router` child has exec'd (the bench has it in its list by then)."""
    try:
        return b"tandem.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_sigterm_stops_the_services_the_bench_started(tmp_path):
    bench = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "bench", "--mode", "plain", "--reduced", "--out", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    services: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not services and time.monotonic() < deadline and bench.poll() is None:
            services = [pid for pid in _children(bench.pid) if _started_service(pid)]
            time.sleep(0.1)
        assert services, "the bench started no service process"
        time.sleep(0.5)  # past Popen's return in the bench
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        assert not [pid for pid in services if _running(pid)], "service processes outlived the bench"
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in services:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
