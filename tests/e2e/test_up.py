"""`tandem up`, `tandem generate` and `tandem health` as real processes."""

import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.bench.services import free_port
from tandem.client import health
from tests.e2e.conftest import ROOT, tandem_cli


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while health(address, timeout=1.0, quiet=True) != 0:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"{address} never became SERVING"
        time.sleep(0.3)


def test_up_generate_health_and_sigterm(tiny_model):
    router, target = free_port(), free_port()
    router_metrics, target_metrics = free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_model),
         "--router-port", str(router), "--target-port", str(target), "--draft", "none",
         "--router-metrics-port", str(router_metrics), "--target-metrics-port", str(target_metrics)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_serving(f"127.0.0.1:{router}", up)
        assert tandem_cli("health", f"127.0.0.1:{target}").returncode == 0
        out = tandem_cli("generate", "The quick brown fox", "--raw", "--max-tokens", "12",
                         "--address", f"127.0.0.1:{router}")
        assert out.returncode == 0, out.stderr
        assert "completion 12 tokens" in out.stderr or "completion" in out.stderr
        assert "speculation: off" in out.stderr
        chat = tandem_cli("generate", "Hello there", "--max-tokens", "5", "--address", f"127.0.0.1:{router}")
        assert chat.returncode == 0, chat.stderr
        # The same prompt again, three completions: the prefix cache serves the prompt.
        three = tandem_cli("generate", "Hello there", "--max-tokens", "5", "--n", "3", "--temperature", "1",
                           "--seed", "5", "--address", f"127.0.0.1:{router}")
        assert three.returncode == 0, three.stderr
        assert all(f"[{i}] " in three.stdout for i in range(3)), three.stdout
        assert " 0 prompt tokens from the prefix cache" not in three.stderr, three.stderr
        # `tandem up` serves each service's Prometheus metrics
        assert scrape_value(router_metrics, "tandem_router_generation_tokens_total") >= 12 + 5 + 15
        assert scrape_value(target_metrics, "tandem_target_steps_total") > 0
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=60)
    assert code == 0
    out = up.stdout.read()  # the router drained and stopped before the target began to stop
    assert 0 <= out.index("router: stopped") < out.index("target: shutting down"), out[-3000:]
    # both services are gone with it
    assert health(f"127.0.0.1:{router}", timeout=1.0, quiet=True) == 1
    assert health(f"127.0.0.1:{target}", timeout=1.0, quiet=True) == 1
    with pytest.raises(OSError):  # and so are their metrics endpoints
        scrape_value(router_metrics, "tandem_router_requests_total")


def test_up_with_tls_dir_and_api_keys(tiny_model, tmp_path):
    """`tandem up --tls-dir` (certificates created on first use) with an API key file: mutual TLS
    between the services, TLS and keys on the public port; `tandem generate` and `tandem health`
    with --tls-dir; a plaintext client gets no answer, a keyless one UNAUTHENTICATED."""
    from tandem.security.tls import TlsConfig

    certs, keys = tmp_path / "certs", tmp_path / "keys"
    keys.write_text("sk-e2e\n")
    router, target = free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_model), "--draft", "none",
         "--router-port", str(router), "--target-port", str(target), "--router-metrics-port", "0",
         "--target-metrics-port", "0", "--tls-dir", str(certs), "--api-key-file", str(keys)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    address = f"127.0.0.1:{router}"
    try:
        deadline = time.monotonic() + 120
        while not (certs / "client-key.pem").exists() or health(address, timeout=1.0, quiet=True, tls=TlsConfig(
                certs / "client.pem", certs / "client-key.pem", certs / "ca.pem")) != 0:
            assert up.poll() is None and time.monotonic() < deadline, up.stdout.read()
            time.sleep(0.3)
        assert tandem_cli("health", f"127.0.0.1:{target}", "--tls-dir", str(certs)).returncode == 0
        assert health(f"127.0.0.1:{target}", timeout=2.0, quiet=True) == 1  # plaintext: no handshake
        out = tandem_cli("generate", "The quick brown fox", "--raw", "--max-tokens", "6", "--address", address,
                         "--tls-dir", str(certs), "--api-key", "sk-e2e")
        assert out.returncode == 0, out.stderr
        assert "completion 6 tokens" in out.stderr
        keyless = tandem_cli("generate", "Hi", "--max-tokens", "2", "--address", address, "--tls-ca", str(certs / "ca.pem"))
        assert keyless.returncode == 1 and "UNAUTHENTICATED" in keyless.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=60)
    assert code == 0
    assert "development certificates created" in up.stdout.read()


def scrape_value(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_health_of_nothing_fails():
    assert tandem_cli("health", f"127.0.0.1:{free_port()}", "--timeout", "1").returncode == 1


def test_bench_reduced_writes_results(tmp_path):
    out = tandem_cli("bench", "--mode", "plain", "--reduced", "--max-tokens", "8", "--concurrency", "2",
                     "--out", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    report = json.loads((tmp_path / "plain-reduced-latest.json").read_text())
    assert report["summary"]["greedy_outputs_identical_over_common_length"] == "4/4"
    assert report["tandem"]["1"]["tokens"] == 32 and report["transformers"]["2"]["tokens"] == 32
    assert report["machine"]["cores"] >= 1 and report["devices"] == {"target": "cpu", "cuda_graphs": False}


def test_prefix_bench_reduced_hits_the_cache_on_one_side_only(tmp_path):
    out = tandem_cli("bench", "--mode", "prefix", "--reduced", "--questions", "2", "--max-tokens", "4",
                     "--out", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    report = json.loads((tmp_path / "prefix-reduced-latest.json").read_text())
    assert report["cache_on"]["requests"] == report["cache_off"]["requests"] == 2
    # The second question finds the shared system prompt cached, on the side that keeps it.
    assert report["cache_on"]["cached_prompt_tokens_total"] > 0
    assert report["cache_off"]["cached_prompt_tokens_total"] == 0
    assert report["summary"]["greedy_outputs_identical"] == "2/2" and report["reduced"]


def test_up_with_an_eagle_draft(tiny_model, tmp_path):
    from tandem.models.eagle_io import random_eagle_checkpoint

    head = random_eagle_checkpoint(tmp_path / "head", tiny_model, seed=1)
    router, target, draft = free_port(), free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_model), "--draft", "eagle",
         "--draft-model", str(head), "--router-port", str(router), "--target-port", str(target),
         "--draft-port", str(draft), "--spec-draft-length", "3"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_serving(f"127.0.0.1:{router}", up)
        assert health(f"127.0.0.1:{draft}", quiet=True) == 0
        out = tandem_cli("generate", "The quick brown fox", "--raw", "--max-tokens", "16",
                         "--address", f"127.0.0.1:{router}")
        assert out.returncode == 0, out.stderr
        assert "speculation:" in out.stderr and "drafted" in out.stderr, out.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=60)
    assert code == 0
    assert health(f"127.0.0.1:{draft}", timeout=1.0, quiet=True) == 1


def test_up_with_a_medusa_tree_draft(tiny_model, tmp_path):
    from tandem.models.medusa import random_medusa_checkpoint

    head = random_medusa_checkpoint(tmp_path / "medusa", tiny_model, num_heads=3, seed=1)
    router, target, draft = free_port(), free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_model), "--draft", "medusa",
         "--draft-model", str(head), "--shape", "tree", "--router-port", str(router),
         "--target-port", str(target), "--draft-port", str(draft), "--spec-draft-length", "3"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_serving(f"127.0.0.1:{router}", up)
        out = tandem_cli("generate", "The quick brown fox", "--raw", "--max-tokens", "16",
                         "--address", f"127.0.0.1:{router}")
        assert out.returncode == 0, out.stderr
        assert "speculation:" in out.stderr and "drafted" in out.stderr, out.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=60)
    assert code == 0


def test_rpc_bench_reduced_measures_both_transports_plain_and_mutual_tls(tmp_path):
    out = tandem_cli("bench", "--mode", "rpc", "--reduced", "--out", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    report = json.loads((tmp_path / "rpc-reduced-latest.json").read_text())
    cells = report["cells"]
    kinds = ("ops_only", "decode", "decode8")
    assert set(cells) == {f"{s}/{t}/{k}" for s in ("plain", "mtls") for t in ("unary", "stream") for k in kinds}
    assert {cells[f"{s}/{t}/ops_only"]["steps"] for s in ("plain", "mtls") for t in ("unary", "stream")} == {32}
    assert {cells[f"{s}/{t}/decode8"]["steps"] for s in ("plain", "mtls") for t in ("unary", "stream")} == {16}
    assert all(c["wall_ms_median"] > 0 for c in cells.values())
    assert report["summary"]["decode"]["stream_over_unary"] > 0 and report["devices"]["target"] == "cpu"
    assert all("mtls_added_fraction_of_step" in report["summary"][k] for k in kinds)
