"""The router's own drafting (--local-draft ngram: prompt lookup, no draft service, no head)
through real target and router servers: lossless like every method (greedy and seeded output
equal plain decoding's, n > 1 too), and it does draft and accept on text that repeats."""

import pytest

from router.config import RouterConfig
from tandem.errors import InvalidArgument
from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import generate_pb2 as pb
from tests.services.harness import generate, start_services
from tests.services.test_generate import sampled

# A prompt that repeats itself: lookup finds the continuation of its last tokens in it.
REPEATS = " ".join(["one two three four five six seven eight"] * 4) + " one two three"


@pytest.fixture(scope="module")
def pair(tiny_model):
    plain = start_services(tiny_model)
    lookup = start_services(tiny_model, router={"local_draft": "ngram", "spec_draft_length": 3,
                                                "ngram_min_n": 1, "ngram_max_n": 3})
    yield plain, lookup
    plain.stop()
    lookup.stop()


def greedy(max_tokens=40, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_output_equals_plain_decoding_with_drafts_verified(pair):
    """(Acceptance on text a real model repeats: tests/e2e/test_lookup_draft.py.)"""
    plain, lookup = pair
    drafted = 0
    for prompt in (REPEATS, *TINY_PROMPTS[:3]):
        want = generate(plain.stub, prompt=prompt, params=greedy())[0]
        got, _, _, last = generate(lookup.stub, prompt=prompt, params=greedy())
        assert got == want, prompt
        drafted += last.usage.draft_tokens
    assert drafted > 0  # the repeating prompt's suffixes were looked up


def test_seeded_and_n_gt_1_output_equals_plain_decoding(pair):
    plain, lookup = pair
    params = sampled(seed=11)
    params.max_tokens = 40
    assert generate(lookup.stub, prompt=REPEATS, params=params)[0] == generate(plain.stub, prompt=REPEATS, params=params)[0]
    for params in (greedy(n=2), sampled(seed=5, n=2)):
        assert choices(lookup, params) == choices(plain, params)


def choices(services, params) -> dict[int, list[int]]:
    """Each choice's tokens, however the steps cut them into responses."""
    out: dict[int, list[int]] = {}
    for r in services.stub.Generate(pb.GenerateRequest(prompt=REPEATS, params=params), timeout=120):
        for c in r.choices:
            out.setdefault(c.index, []).extend(c.token_ids)
    return out


def test_sampled_requests_finish_with_drafts_verified_as_point_masses(pair):
    _, lookup = pair
    ids, _, _, last = generate(lookup.stub, prompt=REPEATS, params=sampled())
    assert len(ids) == 32 and last.choices[-1].finish_reason == "length"
    stats = lookup.wait_idle()
    assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total


def test_the_router_drafts_alone_or_from_a_draft_service_not_both(tmp_path):
    with pytest.raises(InvalidArgument, match="exclusive"):
        RouterConfig(model_dir=tmp_path, draft_address="127.0.0.1:50053", local_draft="ngram")
    with pytest.raises(InvalidArgument, match="ngram_min_n"):
        RouterConfig(model_dir=tmp_path, local_draft="ngram", ngram_min_n=3, ngram_max_n=2)
    with pytest.raises(InvalidArgument, match="local_draft"):
        RouterConfig(model_dir=tmp_path, local_draft="suffix-tree")


@pytest.fixture(scope="module")
def suffix(tiny_model):
    s = start_services(tiny_model, router={"local_draft": "suffix", "spec_draft_length": 4, "suffix_depth": 4})
    yield s
    s.stop()


def test_suffix_trees_are_lossless_and_learn_from_other_requests(pair, suffix):
    plain, _ = pair
    first, _, _, before = generate(suffix.stub, prompt=TINY_PROMPTS[3], params=greedy())
    # The same request again drafts from the first one's output (the recent outputs), as trees.
    again, _, _, after = generate(suffix.stub, prompt=TINY_PROMPTS[3], params=greedy())
    assert first == again == generate(plain.stub, prompt=TINY_PROMPTS[3], params=greedy())[0]
    assert after.usage.accepted_draft_tokens > before.usage.accepted_draft_tokens
    assert after.usage.accepted_draft_tokens >= len(first) // 2  # it knows the whole answer now
    for params in (sampled(seed=3), sampled(seed=4, n=2)):
        params.max_tokens = 40
        assert choices(suffix, params) == choices(plain, params)
    stats = suffix.wait_idle()
    assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total
