"""Token trees at the edges, through real services (a Medusa tree draft on a tiny model): near
the end of the context, on a KV cache barely larger than the request, and a draft service that
sends a malformed tree. None may fail a request (each did before the router trimmed and checked
trees), and greedy output stays the target's."""

import dataclasses

import pytest

from tandem.models.medusa import random_medusa_checkpoint
from tandem.testing.tiny import build_tiny_model
from tests.services.harness import generate, start_services
from tests.services.test_generate import greedy


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, max_position_embeddings=512)


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    return random_medusa_checkpoint(tmp_path_factory.mktemp("medusa") / "heads", model, 4, 1)


def plain_output(model, **request):
    s = start_services(model)
    try:
        return generate(s.stub, **request)[0]
    finally:
        s.stop()


def with_tree(model, heads, target=None):
    return start_services(model, draft_model=heads, draft_method="medusa", draft={"shape": "tree"},
                          router={"spec_draft_length": 4}, target=target)


def test_a_tree_near_the_end_of_the_context_is_trimmed(model, heads):
    request = dict(token_ids=[5 + i % 300 for i in range(490)], params=greedy(22))  # 512 - 490 = 22
    s = with_tree(model, heads)
    try:
        ids, _, _, last = generate(s.stub, **request)
        assert last.usage.draft_tokens > 0 and s.router_engine.figures.step_errors_total == 0
    finally:
        s.stop()
    assert ids == plain_output(model, **request)


def test_a_lone_tree_on_a_tiny_kv_cache_drafts_what_fits(model, heads):
    request = dict(token_ids=[5 + j for j in range(52)], params=greedy(4))  # 56 of 64 KV tokens
    s = with_tree(model, heads, target={"kv_cache_tokens": 64, "kv_page_size": 8})
    try:
        ids = generate(s.stub, **request)[0]
        assert s.router_engine.figures.step_errors_total == 0
    finally:
        s.stop()
    assert ids == plain_output(model, **request)


def test_a_malformed_tree_is_dropped_not_fatal(model, heads):
    s = with_tree(model, heads)

    draft, duplicated = s.draft_engine.draft, []

    def duplicating(request, *rest):  # a draft service giving the root two children with one token
        result = draft(request, *rest)
        tokens = dict(result.tokens)
        for seq_id, parents in (result.parents or {}).items():
            if len(tokens[seq_id]) >= 2 and tuple(parents[:2]) == (0, 0):
                tokens[seq_id] = (tokens[seq_id][0], tokens[seq_id][0], *tokens[seq_id][2:])
                duplicated.append(seq_id)
        return dataclasses.replace(result, tokens=tokens)

    s.draft_engine.draft = duplicating
    try:
        ids = generate(s.stub, prompt="hello there", params=greedy(8))[0]
        assert s.router_engine.figures.step_errors_total == 0 and duplicated
    finally:
        s.stop()
    assert ids == plain_output(model, prompt="hello there", params=greedy(8))
