"""EAGLE speculation through real target, draft and router servers on a tiny model."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from draft_service.config import DraftConfig
from draft_service.server import start_draft
from router.figures import snapshot
from tandem.grpc_server import MAX_RECONNECT_BACKOFF_MS
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import engine_pb2, engine_pb2_grpc
from tandem.v1 import generate_pb2 as pb
from tests.services.harness import generate, start_services
from tests.services.eagle_fixtures import reference, tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.test_generate import greedy, sampled

@pytest.fixture(scope="module")
def eagle(tiny_model, trained_head):
    s = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4})
    yield s
    s.stop()


def draft_stats(services):
    with grpc.insecure_channel(f"127.0.0.1:{services.draft_port}") as ch:
        return engine_pb2_grpc.DraftEngineStub(ch).Stats(engine_pb2.EngineStatsRequest(), timeout=10)


def wait_draft_idle(services, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (stats := draft_stats(services)).sequences_live and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats


def test_trained_head_greedy_equals_target_and_accepts(eagle, reference):
    drafted = accepted = 0
    for prompt in TINY_PROMPTS:
        ids, _, _, last = generate(eagle.stub, prompt=prompt, params=greedy())
        assert ids == reference[prompt], prompt
        drafted += last.usage.draft_tokens
        accepted += last.usage.accepted_draft_tokens
    assert drafted > 0 and accepted / drafted > 0.2  # measured about 0.4 at k = 4
    stats = eagle.stub.Stats(pb.StatsRequest())
    assert stats.speculation_active and stats.mean_accepted_length > 1.5
    assert len(stats.acceptance_by_position) == 4 and stats.acceptance_by_position[0] > 0
    assert 0 < stats.draft_compute_ms_total <= stats.draft_ms_total  # the draft's time inside its RPCs
    assert eagle.wait_idle().sequences_live == 0
    draft = wait_draft_idle(eagle)
    assert draft.sequences_live == 0 and draft.kv_pages_free == draft.kv_pages_total


@pytest.mark.parametrize("layers, draft", [(1, {}), (2, {"shape": "tree", "tree_top_k": 2, "tree_node_budget": 6})])
def test_random_head_greedy_equals_target(tiny_model, reference, tmp_path, layers, draft):
    """Also a head of two decoder layers (a KV layer each in the draft's cache) drafting trees."""
    head = random_eagle_checkpoint(tmp_path / "head", tiny_model, seed=3, num_layers=layers)
    s = start_services(tiny_model, draft_model=head, router={"spec_draft_length": 3}, draft=draft)
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: generate(s.stub, prompt=p, params=greedy())[0], TINY_PROMPTS))
        assert outs == [reference[p] for p in TINY_PROMPTS]
        assert s.stub.Stats(pb.StatsRequest()).draft_tokens_total > 0
    finally:
        s.stop()


def test_concurrent_speculative_streams_equal_target(eagle, reference):
    with ThreadPoolExecutor(len(TINY_PROMPTS)) as pool:
        outs = list(pool.map(lambda p: generate(eagle.stub, prompt=p, params=greedy())[0], TINY_PROMPTS))
    assert outs == [reference[p] for p in TINY_PROMPTS]


def test_steps_past_the_disable_batch_size_draft_nothing_and_the_draft_catches_up(tiny_model, trained_head, reference):
    s = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4, "spec_disable_batch_size": 2})
    try:
        long, short = TINY_PROMPTS[0], TINY_PROMPTS[1:4]
        call = s.stub.Generate(pb.GenerateRequest(prompt=long, params=greedy()), timeout=120)
        ids = list(next(call).choices[0].token_ids)  # the long request runs before the short ones come
        with ThreadPoolExecutor(len(short)) as pool:
            outs = list(pool.map(lambda p: generate(s.stub, prompt=p, params=greedy(max_tokens=4))[0], short))
        paused = s.stub.Stats(pb.StatsRequest())
        ids += [t for r in call for t in r.choices[0].token_ids]
        assert ids == reference[long] and outs == [reference[p][:4] for p in short]
        assert paused.spec_paused_steps_total > 0
        # Alone again, the long request drafts from a KV that absorbed the paused steps' hidden
        # states in one go: with those pairs lost or out of place it accepts nothing (checked).
        after = s.stub.Stats(pb.StatsRequest())
        drafted = after.draft_tokens_total - paused.draft_tokens_total
        accepted = after.accepted_draft_tokens_total - paused.accepted_draft_tokens_total
        assert drafted > 0 and accepted / drafted > 0.2
        assert after.spec_paused_steps_total == paused.spec_paused_steps_total
        assert s.wait_idle().sequences_live == 0
        draft = wait_draft_idle(s)
        assert draft.sequences_live == 0 and draft.kv_pages_free == draft.kv_pages_total
    finally:
        s.stop()


def test_speculation_off_per_request(eagle, reference):
    before = eagle.stub.Stats(pb.StatsRequest()).draft_tokens_total
    ids, _, _, last = generate(eagle.stub, prompt=TINY_PROMPTS[0], params=greedy(speculate=False))
    assert ids == reference[TINY_PROMPTS[0]] and last.usage.draft_tokens == 0
    assert eagle.stub.Stats(pb.StatsRequest()).draft_tokens_total == before


def test_seeded_speculative_sampling_reproducible_in_any_batch(eagle):
    prompt = TINY_PROMPTS[1]
    alone = generate(eagle.stub, prompt=prompt, params=sampled(seed=77))
    again = generate(eagle.stub, prompt=prompt, params=sampled(seed=77))
    assert alone[3].usage.draft_tokens > 0
    jobs = [(prompt, sampled(seed=77))] + [(TINY_PROMPTS[i], sampled(seed=i)) for i in range(5)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda j: generate(eagle.stub, prompt=j[0], params=j[1])[0], jobs))
    assert alone[0] == again[0] == mixed[0]
    assert generate(eagle.stub, prompt=prompt, params=sampled(seed=78))[0] != alone[0]


def test_killing_the_draft_fails_no_request(tiny_model, trained_head, reference):
    s = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4})
    try:
        calls = [s.stub.Generate(pb.GenerateRequest(prompt=p, params=greedy()), timeout=120) for p in TINY_PROMPTS]
        first = [next(c) for c in calls]  # every stream has started (and speculated)
        s.stop_draft()
        outs = []
        for head, call in zip(first, calls):
            outs.append(list(head.choices[0].token_ids) + [t for r in call for t in r.choices[0].token_ids])
        assert outs == [reference[p] for p in TINY_PROMPTS]
        stats = s.stub.Stats(pb.StatsRequest())
        assert not stats.speculation_active
        # new requests are served plain
        ids, _, _, last = generate(s.stub, prompt=TINY_PROMPTS[0], params=greedy())
        assert ids == reference[TINY_PROMPTS[0]] and last.usage.draft_tokens == 0
        assert s.wait_idle().sequences_live == 0
        # a draft back on the same port: new requests speculate again
        config = DraftConfig(method="eagle", model_dir=trained_head, target_model_dir=tiny_model,
                             target_address=f"127.0.0.1:{s.target_port}", port=s.draft_port)
        s.draft_server, _, _, s.draft_engine, _ = start_draft(config)
        deadline = time.monotonic() + 30
        while not s.stub.Stats(pb.StatsRequest()).speculation_active:
            assert time.monotonic() < deadline, "the router never saw the draft healthy again"
            time.sleep(0.2)
        ids, _, _, last = generate(s.stub, prompt=TINY_PROMPTS[1], params=greedy())
        assert ids == reference[TINY_PROMPTS[1]] and last.usage.draft_tokens > 0
    finally:
        s.stop()


def test_requests_that_lost_the_draft_speculate_again_once_it_is_back(tiny_model, trained_head):
    """They re-prefill (the draft rebuilds their context from the target's hidden states) and
    carry on speculating, their output the same as plain decoding's."""
    s = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4, "draft_probe_s": 0.05})
    try:
        s.stop_draft()
        generate(s.stub, prompt=TINY_PROMPTS[0], params=greedy())  # the router finds the draft gone
        assert not s.stub.Stats(pb.StatsRequest()).speculation_active
        config = DraftConfig(method="eagle", model_dir=trained_head, target_model_dir=tiny_model,
                             target_address=f"127.0.0.1:{s.target_port}", port=s.draft_port)
        s.draft_server, health, _, s.draft_engine, _ = start_draft(config)
        health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # up, not yet ready
        # The router's channel reconnects within its backoff cap; from then on its probes get
        # NOT_SERVING, and SERVING is seen within one probe (these requests last a second).
        time.sleep(2.5 * MAX_RECONNECT_BACKOFF_MS / 1e3)  # the cap, 20% jitter, a slow machine
        params = greedy(max_tokens=400)
        calls = [s.stub.Generate(pb.GenerateRequest(prompt=p, params=params), timeout=120) for p in TINY_PROMPTS[:2]]
        firsts = [next(c) for c in calls]  # both run, plainly
        health.set("", health_pb2.HealthCheckResponse.SERVING)
        outs, lasts = [], []
        for first, call in zip(firsts, calls):
            rest = list(call)
            outs.append(list(first.choices[0].token_ids) + [t for r in rest for t in r.choices[0].token_ids])
            lasts.append(rest[-1])
        assert all(last.usage.draft_tokens > 0 for last in lasts), "a running request never speculated again"
        figures = snapshot(s.router_engine)
        assert figures.respeculations_total == 2 and figures.draft_failures_total == 1
        plain = [generate(s.stub, prompt=p, params=greedy(max_tokens=400, speculate=False))[0] for p in TINY_PROMPTS[:2]]
        assert outs == plain
        assert s.wait_idle().sequences_live == 0 and wait_draft_idle(s).sequences_live == 0
    finally:
        s.stop()


def test_chunked_prefill_feeds_the_draft_correctly(tiny_model, trained_head, reference):
    # Chunks of 3: each chunk's last hidden state waits for the next chunk's first token. A pair
    # out of place would show as acceptance near zero (the trained head accepts ~half).
    s = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4, "prefill_chunk_size": 3})
    try:
        drafted = accepted = 0
        for prompt in TINY_PROMPTS:
            ids, _, _, last = generate(s.stub, prompt=prompt, params=greedy())
            assert ids == reference[prompt], prompt
            drafted += last.usage.draft_tokens
            accepted += last.usage.accepted_draft_tokens
        assert drafted > 0 and accepted / drafted > 0.2
    finally:
        s.stop()


def test_a_request_cancelled_while_its_draft_is_computed_leaves_the_others_running(tiny_model, trained_head):
    """The router awaits the draft with the step's plan in hand; a sequence released meanwhile
    (its client went away) is dropped from the plan, not looked up in the KV view it left (that
    failed the step, and with it every running request)."""
    s = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4})
    hold, held, go = threading.Event(), threading.Event(), threading.Event()
    draft = s.draft_engine.draft

    def held_draft(request, *args):
        if hold.is_set() and len(request.seqs) == 2 and not go.is_set():
            held.set()
            go.wait(30)
        return draft(request, *args)

    try:
        s.draft_engine.draft = held_draft
        params = greedy(max_tokens=400)
        other = s.stub.Generate(pb.GenerateRequest(prompt=TINY_PROMPTS[1], params=params), timeout=60)
        doomed = s.stub.Generate(pb.GenerateRequest(prompt=TINY_PROMPTS[0], params=params), timeout=60)
        first = next(other)
        next(doomed)
        hold.set()
        assert held.wait(30)  # a draft call for both is held
        doomed.cancel()
        deadline = time.monotonic() + 30
        while snapshot(s.router_engine).requests_running > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        go.set()
        out = list(first.choices[0].token_ids) + [t for r in other for t in r.choices[0].token_ids]
        assert out == generate(s.stub, prompt=TINY_PROMPTS[1], params=greedy(max_tokens=400, speculate=False))[0]
        assert s.router_engine.figures.step_errors_total == 0
        assert s.wait_idle().sequences_live == 0 and wait_draft_idle(s).sequences_live == 0
    finally:
        go.set()
        s.stop()
