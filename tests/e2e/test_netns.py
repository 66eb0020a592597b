"""The target and the draft on two hosts: two network namespaces joined by a veth pair, the link
cut and restored mid-load. Requests complete with their outputs unchanged; speculation goes off
while the draft is unreachable and comes back once the link is. Every channel between the
services is mutual TLS (certificates naming the namespaces' addresses), as across real hosts.

Namespace T holds the target and the router (on its loopback) and 10.203.0.1/30; namespace D
the draft and 10.203.0.2/30. Nothing is added to the host's own namespace. Needs root and
`ip netns`; skipped otherwise.
"""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.security.certs import create_dir
from tests import reliability
from tests.e2e.faults import PROMPTS, ROOT, wait_for

pytestmark = pytest.mark.netns

TARGET_IP, DRAFT_IP = "10.203.0.1", "10.203.0.2"
ROUTER, TARGET, DRAFT = 50051, 50052, 50053  # each namespace has ports of its own
MAX_TOKENS = 400


class Link:
    """Two fresh namespaces and a veth pair between them; `close` deletes both (and the pair
    with them)."""

    def __init__(self, logs: Path):
        self.logs = logs  # each process's output, for a failure's diagnosis
        tag = uuid.uuid4().hex[:6]
        self.target_ns, self.draft_ns = f"tandem-t-{tag}", f"tandem-d-{tag}"
        self.target_dev, self.draft_dev = f"tdm{tag}t", f"tdm{tag}d"
        self.made: list[str] = []
        self.certs: Path | None = None  # the services' certificates (the fixture's)

    def open(self) -> None:
        for ns in (self.target_ns, self.draft_ns):
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.target_ns, "link", "add", self.target_dev, "type", "veth",
            "peer", "name", self.draft_dev, "netns", self.draft_ns)
        for ns, dev, ip in ((self.target_ns, self.target_dev, TARGET_IP), (self.draft_ns, self.draft_dev, DRAFT_IP)):
            _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

    def set(self, up: bool) -> None:
        _ip("-n", self.target_ns, "link", "set", self.target_dev, "up" if up else "down")

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def spawn(self, ns: str, *args: str) -> subprocess.Popen:
        """`python -m ARGS` in namespace `ns`; its output to a file (an unread pipe would block it)."""
        with open(self.logs / f"{args[1]}.log", "w") as log:
            return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", *args], cwd=ROOT,
                                    stdout=log, stderr=subprocess.STDOUT, text=True)

    def run(self, ns: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def link(tmp_path):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    link = Link(tmp_path)
    try:
        try:
            link.open()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"ip netns unavailable: {e.stderr.strip()}")
        yield link
    finally:
        link.close()


def _identity(certs: Path, name: str) -> tuple[str, ...]:
    return ("--tls-cert", str(certs / f"{name}.pem"), "--tls-key", str(certs / f"{name}-key.pem"),
            "--tls-ca", str(certs / "ca.pem"))


@pytest.fixture
def services(link, tiny_model, tmp_path):
    head = random_eagle_checkpoint(tmp_path / "head", tiny_model, seed=1)
    certs = tmp_path / "certs"
    create_dir(certs, hosts=[TARGET_IP, DRAFT_IP])
    link.certs = certs
    common = ("--model", str(tiny_model), "--metrics-port", "0")
    procs = []
    try:
        procs.append(link.spawn(link.target_ns, "tandem.cli", "target", *common, "--host", "0.0.0.0",
                                "--port", str(TARGET), *_identity(certs, "target")))
        _wait_serving(link, link.target_ns, TARGET, procs)
        procs.append(link.spawn(link.draft_ns, "tandem.cli", "draft", *common, "--method", "eagle",
                                "--draft-model", str(head), "--host", "0.0.0.0", "--port", str(DRAFT),
                                "--target", f"{TARGET_IP}:{TARGET}", *_identity(certs, "draft")))
        _wait_serving(link, link.draft_ns, DRAFT, procs)
        procs.append(link.spawn(link.target_ns, "tandem.cli", "router", *common, "--host", "127.0.0.1",
                                "--port", str(ROUTER), "--target", f"127.0.0.1:{TARGET}",
                                "--draft", f"{DRAFT_IP}:{DRAFT}", "--spec-draft-length", "3",
                                "--spec-disable-batch-size", "64", *_identity(certs, "router")))
        _wait_serving(link, link.target_ns, ROUTER, procs)
        yield link
    finally:
        for p in reversed(procs):  # the router first
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _wait_serving(link: Link, ns: str, port: int, procs) -> None:
    def up() -> bool:
        assert all(p.poll() is None for p in procs), "a service exited at start"
        tls = ("--tls-dir", str(link.certs)) if port != ROUTER else ()  # the router's public port: plaintext here
        return link.run(ns, "tandem.cli", "health", f"127.0.0.1:{port}", "--timeout", "1", *tls).returncode == 0

    wait_for(up, 120, f"127.0.0.1:{port} in {ns} to serve", step_s=0.5)


def _stats(link: Link) -> dict:
    out = link.run(link.target_ns, "tests.e2e.faults", "stats", f"127.0.0.1:{ROUTER}")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


class Load:
    """tests/e2e/faults.py's client, in the router's namespace."""

    def __init__(self, link: Link, max_tokens: int = MAX_TOKENS):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", link.target_ns, sys.executable, "-m", "tests.e2e.faults", "load",
             f"127.0.0.1:{ROUTER}", str(max_tokens), *PROMPTS],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def wait_streaming(self) -> None:
        line = self.proc.stdout.readline()
        assert line.strip() == "streaming", line + self.proc.stderr.read()[-2000:]

    def outcomes(self) -> list[dict]:
        out, err = self.proc.communicate(timeout=240)
        assert self.proc.returncode == 0, err[-2000:]
        return json.loads(out.splitlines()[-1])  # after "streaming", unless wait_streaming read it


def test_a_cut_link_between_target_and_draft_costs_speculation_not_requests(services):
    link = services
    reference = Load(link).outcomes()
    assert all(o["code"] == "OK" and o["draft_tokens"] > 0 for o in reference)
    load = Load(link)
    load.wait_streaming()
    link.set(up=False)
    try:
        # The router's draft call times out: it serves on without the draft.
        wait_for(lambda: not _stats(link).get("speculationActive", False), 60, "speculation to go off", step_s=0.5)
    finally:
        link.set(up=True)
    outcomes = load.outcomes()
    assert [o["code"] for o in outcomes] == ["OK"] * len(PROMPTS)
    assert [o["tokens"] for o in outcomes] == [o["tokens"] for o in reference]
    wait_for(lambda: _stats(link).get("speculationActive", False), 90, "speculation to come back", step_s=1.0)
    again = Load(link, max_tokens=32).outcomes()
    assert [o["tokens"] for o in again] == [o["tokens"][:32] for o in reference]
    assert any(o["draft_tokens"] > 0 for o in again), "no new request was drafted for"
    reliability.served(len(reference) + len(outcomes) + len(again))
    reliability.faults()
