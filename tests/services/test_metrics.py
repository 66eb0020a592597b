"""Prometheus /metrics of the three services (real servers on loopback, a tiny model and a
random EAGLE head): the figures are served, they move as requests run, and the Stats RPCs
report the same numbers."""

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.bench.services import free_port
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.testing.tiny import build_tiny_model
from tandem.v1 import engine_pb2, engine_pb2_grpc
from tandem.v1 import generate_pb2 as pb
from tests.services.harness import generate, start_services

PROMPT = [5, 9, 3, 17, 2, 11, 4, 8, 6, 13]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0, max_position_embeddings=512)
    head = random_eagle_checkpoint(tmp_path_factory.mktemp("heads") / "random", model, seed=3)
    ports = {"router": free_port(), "target": free_port(), "draft": free_port()}
    s = start_services(model, draft_model=head, router={"spec_draft_length": 3, "metrics_port": ports["router"]},
                       target={"metrics_port": ports["target"]}, draft={"metrics_port": ports["draft"]})
    s.metrics_ports = ports
    yield s
    s.stop()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of http://127.0.0.1:port/metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def engine_stats(port: int, stub) -> engine_pb2.EngineStats:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return stub(ch).Stats(engine_pb2.EngineStatsRequest(), timeout=10)


def greedy(max_tokens: int, **fields) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


def run_requests(s) -> None:
    """One that runs to its length, one that stops on a token, one cancelled mid-stream."""
    ids, _, _, last = generate(s.stub, token_ids=PROMPT, params=greedy(12))
    assert last.choices[0].finish_reason == "length" and last.usage.draft_tokens > 0
    _, _, _, last = generate(s.stub, token_ids=PROMPT, params=greedy(12, stop_token_ids=[ids[2]]))
    assert last.choices[0].finish_reason == "stop"
    call = s.stub.Generate(pb.GenerateRequest(token_ids=PROMPT[:6], params=greedy(400)), timeout=60)
    next(call)
    call.cancel()


def wait_finished(port: int, total: float, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)
        done = sum(v for (name, _), v in samples.items() if name == "tandem_router_requests_finished_total")
        if done >= total or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_metrics_move_as_requests_run(served):
    s, ports = served, served.metrics_ports
    before = {name: scrape(port) for name, port in ports.items()}
    run_requests(s)
    finished_before = sum(v for (n, _), v in before["router"].items() if n == "tandem_router_requests_finished_total")
    router = wait_finished(ports["router"], finished_before + 3)
    s.wait_idle()
    router = scrape(ports["router"])
    target, draft = scrape(ports["target"]), scrape(ports["draft"])

    def grew(samples, old, name, by=1, **labels):
        assert value(samples, name, **labels) >= value(old, name, **labels) + by, (name, labels)

    r0 = before["router"]
    grew(router, r0, "tandem_router_requests_total", 3)
    for reason in ("length", "stop", "cancelled"):
        grew(router, r0, "tandem_router_requests_finished_total", 1, reason=reason)
    assert value(router, "tandem_router_requests_finished_total", reason="error") == 0
    grew(router, r0, "tandem_router_time_to_first_token_seconds_count", 3)
    grew(router, r0, "tandem_router_request_duration_seconds_count", 3)
    grew(router, r0, "tandem_router_inter_token_latency_seconds_count", 11)
    grew(router, r0, "tandem_router_prefill_step_seconds_count")
    grew(router, r0, "tandem_router_decode_step_seconds_count")
    grew(router, r0, "tandem_router_generation_tokens_total", 12 + 3)
    grew(router, r0, "tandem_router_prompt_tokens_total", 2 * len(PROMPT) + 6)
    grew(router, r0, "tandem_router_draft_tokens_total")
    grew(router, r0, "tandem_router_draft_position_proposed_total", position="0")
    assert value(router, "tandem_router_time_to_first_token_seconds_bucket", le="+Inf") == value(
        router, "tandem_router_time_to_first_token_seconds_count")
    assert 0.0 <= value(router, "tandem_router_prefix_cache_hit_ratio") <= 1.0
    assert value(router, "tandem_router_prompt_tokens_cached_total") <= value(router, "tandem_router_prompt_tokens_total")
    assert 0 <= value(router, "tandem_router_kv_pages_used") <= value(router, "tandem_router_kv_pages_total")
    assert value(router, "tandem_router_kv_pages_total") > 0
    assert value(router, "tandem_router_requests_waiting") == 0 and value(router, "tandem_router_requests_running") == 0
    assert value(router, "tandem_router_speculation_active") == 1

    t0, d0 = before["target"], before["draft"]
    grew(target, t0, "tandem_target_steps_total", 3)
    grew(target, t0, "tandem_target_step_duration_seconds_count", 3)
    grew(target, t0, "tandem_target_prefill_tokens_total", len(PROMPT))
    grew(target, t0, "tandem_target_decode_tokens_total", 3)
    grew(target, t0, "tandem_target_verified_draft_tokens_total")
    assert value(target, "tandem_target_kv_pages_total") > 0
    assert value(target, "tandem_target_kv_pages_used") == 0 and value(target, "tandem_target_sequences") == 0  # idle
    grew(draft, d0, "tandem_draft_steps_total")
    grew(draft, d0, "tandem_draft_step_duration_seconds_count")
    grew(draft, d0, "tandem_draft_proposed_tokens_total")
    assert value(draft, "tandem_draft_sequences") >= 0


def test_stats_rpcs_report_the_same_figures(served):
    s, ports = served, served.metrics_ports
    run_requests(s)
    wait_finished(ports["router"], value(scrape(ports["router"]), "tandem_router_requests_total"))
    s.wait_idle()
    router, stats = scrape(ports["router"]), s.stub.Stats(pb.StatsRequest(), timeout=10)
    assert stats.requests_total == value(router, "tandem_router_requests_total")
    assert stats.generation_tokens_total == value(router, "tandem_router_generation_tokens_total")
    assert stats.time_to_first_token.count == value(router, "tandem_router_time_to_first_token_seconds_count")
    assert stats.time_to_first_token.sum == pytest.approx(value(router, "tandem_router_time_to_first_token_seconds_sum"))
    assert 0 < stats.time_to_first_token.p50 <= stats.time_to_first_token.p90 <= stats.time_to_first_token.p99
    assert stats.inter_token_latency.count == value(router, "tandem_router_inter_token_latency_seconds_count")
    assert stats.request_duration.count == value(router, "tandem_router_request_duration_seconds_count")
    assert stats.prefill_step.count + stats.decode_step.count <= stats.steps_total
    assert dict(stats.finished_by_reason) == {
        r: value(router, "tandem_router_requests_finished_total", reason=r) for r in ("stop", "length", "cancelled", "error")}
    assert list(stats.proposed_by_position) == [
        value(router, "tandem_router_draft_position_proposed_total", position=str(i)) for i in range(len(stats.proposed_by_position))]
    assert list(stats.accepted_by_position) == [
        value(router, "tandem_router_draft_position_accepted_total", position=str(i)) for i in range(len(stats.accepted_by_position))]
    assert stats.prefix_cache_hit_rate == pytest.approx(value(router, "tandem_router_prefix_cache_hit_ratio"))
    assert stats.requests_waiting == 0 and stats.tokens_per_second > 0 and stats.uptime_s > 0
    assert stats.kv_pages_used == value(router, "tandem_router_kv_pages_used")

    target = engine_stats(s.target_port, engine_pb2_grpc.TargetEngineStub)
    scraped = scrape(ports["target"])
    assert target.steps_total == value(scraped, "tandem_target_steps_total")
    assert target.step_seconds.count == value(scraped, "tandem_target_step_duration_seconds_count")
    assert target.step_seconds.count < target.steps_total  # wait_idle's removes: an ops-only step, no model run
    assert target.prefill_tokens_total == value(scraped, "tandem_target_prefill_tokens_total")
    assert target.verified_draft_tokens_total == value(scraped, "tandem_target_verified_draft_tokens_total")
    draft = engine_stats(s.draft_port, engine_pb2_grpc.DraftEngineStub)
    scraped = scrape(ports["draft"])
    assert draft.steps_total == value(scraped, "tandem_draft_steps_total")
    assert draft.step_seconds.count == value(scraped, "tandem_draft_step_duration_seconds_count") < draft.steps_total
    assert draft.proposed_draft_tokens_total == value(scraped, "tandem_draft_proposed_tokens_total") > 0
