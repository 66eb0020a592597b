"""EAGLE-2 dynamic trees through real target, draft and router servers on a tiny model: the
draft grows trees, the target verifies them, greedy output equals the target alone."""

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import engine_pb2, engine_pb2_grpc
from tandem.v1 import generate_pb2 as pb
from tests.services.eagle_fixtures import reference, tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.harness import generate, start_services
from tests.services.test_generate import greedy, sampled

TREE = {"shape": "tree", "tree_top_k": 3, "tree_node_budget": 10}


@pytest.fixture(scope="module")
def eagle_tree(tiny_model, trained_head):
    s = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4}, draft=TREE)
    yield s
    s.stop()


def draft_stub(services):
    return engine_pb2_grpc.DraftEngineStub(grpc.insecure_channel(f"127.0.0.1:{services.draft_port}"))


def test_draft_info_says_tree(eagle_tree):
    info = draft_stub(eagle_tree).Info(engine_pb2.InfoRequest(), timeout=10)
    assert info.shape == "tree" and info.max_draft_tokens == 10


def test_greedy_trees_equal_target_and_accept_more_than_one(eagle_tree, reference):
    drafted = accepted = 0
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: generate(eagle_tree.stub, prompt=p, params=greedy()), TINY_PROMPTS))
    for prompt, (ids, _, _, last) in zip(TINY_PROMPTS, outs):
        assert ids == reference[prompt], prompt
        drafted += last.usage.draft_tokens
        accepted += last.usage.accepted_draft_tokens
    assert drafted > 0 and accepted > 0
    stats = eagle_tree.stub.Stats(pb.StatsRequest())
    assert stats.speculation_active and stats.mean_accepted_length > 1.5


def test_sampled_trees_run_and_leave_no_pages(eagle_tree, monkeypatch):
    """Sampled trees reach the target with their proposals (over the peer stream, flagged by the
    router) and are verified with them; a seeded request (keyed draws: top-k trees verified
    without proposals) repeats itself."""
    engine, proposals = eagle_tree.target_engine, []
    verify_tree = engine._verify_tree

    def spy(e, rows, q, *rest):  # rest: the grammar's rows, when constrained
        proposals.append((e.sampled_tree, q is not None and q.shape[0] == e.num_draft_tokens + 1))
        return verify_tree(e, rows, q, *rest)

    monkeypatch.setattr(engine, "_verify_tree", spy)
    ids, _, _, last = generate(eagle_tree.stub, prompt=TINY_PROMPTS[2], params=sampled())
    assert len(ids) == 32 and last.usage.draft_tokens > 0
    assert proposals and all(flag and fits for flag, fits in proposals)
    proposals.clear()
    ids, _, _, last = generate(eagle_tree.stub, prompt=TINY_PROMPTS[2], params=sampled(seed=11))
    assert last.usage.draft_tokens > 0 and proposals and not any(flag or fits for flag, fits in proposals)
    again, _, _, _ = generate(eagle_tree.stub, prompt=TINY_PROMPTS[2], params=sampled(seed=11))
    assert again == ids
    assert eagle_tree.wait_idle().sequences_live == 0
    stub, deadline = draft_stub(eagle_tree), time.monotonic() + 10
    while (stats := stub.Stats(engine_pb2.EngineStatsRequest(), timeout=10)).sequences_live:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert stats.kv_pages_free == stats.kv_pages_total


def test_acceptance_per_depth_in_usage_and_stats(eagle_tree, reference):
    prompt = TINY_PROMPTS[0]
    ids, _, _, last = generate(eagle_tree.stub, prompt=prompt, params=greedy())
    usage = last.usage
    assert ids == reference[prompt]
    # accepted_by_depth[i]: verify steps whose accepted path reached depth i + 1: non-increasing,
    # bounded by the verify steps, and summing to the accepted drafts.
    by_depth = list(usage.accepted_by_depth)
    assert usage.verify_steps > 0 and by_depth and by_depth[0] <= usage.verify_steps
    assert all(a >= b for a, b in zip(by_depth, by_depth[1:]))
    assert sum(by_depth) == usage.accepted_draft_tokens
    stats = eagle_tree.stub.Stats(pb.StatsRequest())
    rates = list(stats.acceptance_by_position)
    assert 1 <= len(rates) <= 4 and all(0 <= r <= 1 for r in rates) and rates[0] > 0
