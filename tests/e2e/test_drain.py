"""SIGTERM drains the router: health NOT_SERVING first, new requests UNAVAILABLE while the port
stays open, the running request finishes whole within the grace period, then the process exits
0. Real target and router processes on loopback, the tiny model."""

import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.bench.services import free_port
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc
from tests import reliability
from tests.e2e.conftest import ROOT
from tests.e2e.faults import serving, wait_for

MAX_TOKENS = 480


def _spawn(*args: str, level: str = "WARNING") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", "--log-level", level, *args, "--metrics-port", "0"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def stack(tiny_model):
    target_port, router_port = free_port(), free_port()
    procs = [_spawn("target", "--model", str(tiny_model), "--host", "127.0.0.1", "--port", str(target_port))]
    try:
        wait_for(lambda: serving(f"127.0.0.1:{target_port}"), 120, "the target")
        procs.append(_spawn("router", "--model", str(tiny_model), "--host", "127.0.0.1", "--port", str(router_port),
                            "--target", f"127.0.0.1:{target_port}", "--shutdown-grace-s", "60", level="INFO"))
        wait_for(lambda: serving(f"127.0.0.1:{router_port}"), 120, "the router")
        yield procs[1], f"127.0.0.1:{router_port}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def test_sigterm_drains_the_router(stack):
    router, address = stack
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, n=4)
        call = stub.Generate(pb.GenerateRequest(prompt="The quick brown fox", params=params), timeout=120)
        first = next(call)  # it runs
        outcome = {}

        def drain():
            responses = [first, *call]
            outcome["tokens"] = sum(len(c.token_ids) for r in responses for c in r.choices)
            outcome["reasons"] = {c.finish_reason for r in responses for c in r.choices if c.finish_reason}

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        router.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                 == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()
        thread.join(90)
    assert outcome == {"tokens": 4 * MAX_TOKENS, "reasons": {"length"}}  # finished whole, not cancelled
    assert router.wait(60) == 0
    log = router.stderr.read()
    assert "for 1 live requests" in log and "router: stopped" in log, log[-2000:]  # it was running at the SIGTERM
    reliability.faults()
    reliability.served()
