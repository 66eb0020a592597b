"""Request trees (n > 1), the prefix cache, chunked prefill and preemption through real target,
draft and router servers on a 1-layer tiny model with a briefly trained EAGLE head (the head
accepts about half its drafts, so verify paths with accepted and rejected drafts both run).

After each test, nothing is left in either model service once the prefix cache is flushed."""

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import engine_pb2, engine_pb2_grpc
from tandem.v1 import generate_pb2 as pb
from tests.services.harness import generate, start_services
from tests.services.eagle_fixtures import reference, tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.test_generate import NEW_TOKENS, greedy, sampled


@pytest.fixture
def launch(tiny_model, trained_head):
    """Starts services (EAGLE unless eagle=False); checks for leaks and stops them after."""
    started = []

    def start(eagle=True, target=None, **router):
        s = start_services(tiny_model, draft_model=trained_head if eagle else None, target=target, router=router)
        started.append(s)
        return s

    yield start
    try:
        for s in started:
            assert_no_leaks(s)
    finally:
        for s in started:
            s.stop()


def assert_no_leaks(s):
    assert s.router_engine.figures.kv_mirror_mismatches == 0  # the router's page view was exact
    stats = s.wait_idle()
    assert stats.sequences_live == 0 and stats.kv_pages_free == stats.kv_pages_total, stats
    if s.draft_server is not None:
        deadline = time.monotonic() + 10
        while (d := draft_stats(s)).sequences_live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.sequences_live == 0 and d.kv_pages_free == d.kv_pages_total, d


def draft_stats(s):
    with grpc.insecure_channel(f"127.0.0.1:{s.draft_port}") as ch:
        return engine_pb2_grpc.DraftEngineStub(ch).Stats(engine_pb2.EngineStatsRequest(), timeout=10)


def choices(responses) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in responses:
        for c in r.choices:
            out.setdefault(c.index, []).extend(c.token_ids)
    return out


def generate_n(stub, n, params, **fields):
    params.n = n
    _, _, responses, last = generate(stub, params=params, **fields)
    finished = [c.index for r in responses for c in r.choices if c.finish_reason]
    assert sorted(finished) == list(range(n))  # every choice finishes once
    return choices(responses), last.usage


# -- n > 1 ------------------------------------------------------------------------------------


def test_n4_with_slots_for_two_eagle_greedy_children_equal_target(launch, reference):
    # k = 4: each running sequence counts 5 of max_num_sequence = 10, so 2 children run at once.
    s = launch(spec_draft_length=4, max_num_sequence=10)
    for prompt in TINY_PROMPTS[:3]:
        out, usage = generate_n(s.stub, 4, greedy(), prompt=prompt)
        assert out == {i: reference[prompt] for i in range(4)}, prompt
        assert usage.completion_tokens == 4 * NEW_TOKENS and usage.prompt_tokens > 0
        assert usage.draft_tokens > 0 and usage.accepted_draft_tokens > 0  # the children speculate


def test_n4_seeded_children_reproducible_and_distinct(launch):
    s = launch(spec_draft_length=3, max_num_sequence=8)
    first, _ = generate_n(s.stub, 4, sampled(seed=99), prompt=TINY_PROMPTS[1])
    again, _ = generate_n(s.stub, 4, sampled(seed=99), prompt=TINY_PROMPTS[1])
    assert first == again
    assert len({tuple(v) for v in first.values()}) > 1  # each child has its own stream
    # Reproducible whatever else runs beside it.
    with ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(generate, s.stub, prompt=p, params=sampled(seed=i)) for i, p in enumerate(TINY_PROMPTS[2:5])]
        busy, _ = generate_n(s.stub, 4, sampled(seed=99), prompt=TINY_PROMPTS[1])
        [f.result() for f in noise]
    assert busy == first


def test_n3_plain_and_one_token_prompt(launch, reference):
    s = launch(eagle=False, max_num_sequence=2)
    out, _ = generate_n(s.stub, 3, greedy(), prompt=TINY_PROMPTS[0])
    assert out == {i: reference[TINY_PROMPTS[0]] for i in range(3)}
    single, _ = generate_n(s.stub, 2, greedy(8), token_ids=[7])  # nothing to share: two roots
    assert single[0] == single[1] and len(single[0]) == 8


def test_cancelled_tree_leaves_nothing(launch):
    s = launch(spec_draft_length=2, max_num_sequence=6)
    params = greedy(NEW_TOKENS)
    params.n = 4
    call = s.stub.Generate(pb.GenerateRequest(prompt=TINY_PROMPTS[3], params=params), timeout=60)
    next(call)
    call.cancel()
    assert generate(s.stub, prompt=TINY_PROMPTS[0], params=greedy(8))[0]  # still serving


# -- prefix cache -----------------------------------------------------------------------------


def test_prefix_cache_on_and_off_give_equal_outputs_and_hits_are_reported(launch, reference):
    on, off = launch(), launch(prefix_cache_max_num_recycling_seqs=0)
    prompts = list(TINY_PROMPTS[:4]) + [TINY_PROMPTS[0] + " jumps", TINY_PROMPTS[0] + " sleeps"]
    for s, cached_expected in ((on, True), (off, False)):
        cached = []
        for prompt in prompts + prompts[:2]:  # repeats and shared prefixes
            ids, _, _, last = generate(s.stub, prompt=prompt, params=greedy())
            if prompt in reference:
                assert ids == reference[prompt], prompt
            cached.append(last.usage.cached_prompt_tokens)
        assert any(cached) == cached_expected, cached
    # Shared-prefix and repeated prompts give the same text with or without the cache.
    for prompt in prompts:
        assert generate(on.stub, prompt=prompt, params=greedy())[0] == generate(off.stub, prompt=prompt, params=greedy())[0]
    assert on.stub.Stats(pb.StatsRequest()).cached_prompt_tokens_total > 0


def test_repeated_prompt_prefills_fewer_tokens(launch):
    s = launch(eagle=False)
    prompt = TINY_PROMPTS[5]
    generate(s.stub, prompt=prompt, params=greedy(1))
    before = s.target_stats().tokens_total
    _, _, _, last = generate(s.stub, prompt=prompt, params=greedy(1))
    prompt_tokens = last.usage.prompt_tokens
    # Plain decoding: everything but the last prompt token is cached; that one is prefilled.
    assert last.usage.cached_prompt_tokens == prompt_tokens - 1
    assert s.target_stats().tokens_total - before == 1


def test_design_worked_example_eagle_forks_one_token_earlier(launch):
    """DESIGN.md section 3: target KV [0,1,2], draft KV [1,2,3] (3 sampled, not yet in the
    target's KV); the prompt [0,1,4] matches 2 tokens, EAGLE forks at 1: the target prefills
    [1,4] (the draft [4,5], equal lengths)."""
    s, ref = launch(), launch(prefix_cache_max_num_recycling_seqs=0)
    first = generate(s.stub, token_ids=[10, 11], params=greedy(2))[0]  # KV [10, 11, a], sampled b
    other = next(t for t in range(20, 40) if t != first[0])
    before = s.target_stats().tokens_total
    ids, _, _, last = generate(s.stub, token_ids=[10, 11, other], params=greedy(1))
    assert last.usage.cached_prompt_tokens == 1
    assert s.target_stats().tokens_total - before == 2  # [11, other]
    assert ids == generate(ref.stub, token_ids=[10, 11, other], params=greedy(1))[0]
    # And it keeps speculating correctly from there.
    longer = generate(s.stub, token_ids=[10, 11, other], params=greedy())
    assert longer[0] == generate(ref.stub, token_ids=[10, 11, other], params=greedy())[0]
    assert longer[3].usage.accepted_draft_tokens > 0


def test_children_match_prefixes_of_earlier_requests(launch, reference):
    s = launch(spec_draft_length=3, max_num_sequence=8)
    prompt = TINY_PROMPTS[4]
    generate(s.stub, prompt=prompt, params=greedy())
    out, usage = generate_n(s.stub, 3, greedy(), prompt=prompt)
    assert usage.cached_prompt_tokens > 0
    assert out == {i: reference[prompt] for i in range(3)}
    # A later single request matches what a child left behind (prompt + its output).
    ids, _, _, last = generate(s.stub, prompt=prompt, params=greedy())
    assert ids == reference[prompt] and last.usage.cached_prompt_tokens > 0


# -- chunked prefill and preemption -----------------------------------------------------------


def test_long_prompts_over_several_chunks_equal_one_chunk(launch):
    long_prompt = " ".join(TINY_PROMPTS)  # about 110 tokens
    one, chunked = launch(), launch(prefill_chunk_size=8)
    for n in (1, 2):
        a, _ = generate_n(one.stub, n, greedy(), prompt=long_prompt)
        b, _ = generate_n(chunked.stub, n, greedy(), prompt=long_prompt)
        assert a == b and len(a[0]) == NEW_TOKENS


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
def test_preemption_under_a_small_kv_cache_loses_nothing(launch, reference, eagle):
    # 20 pages of 8 tokens; 8 requests of 10-24 + 64 tokens need far more at once.
    s = launch(eagle=eagle, target={"kv_cache_tokens": 160, "kv_page_size": 8})
    with ThreadPoolExecutor(8) as pool:
        futures = {p: pool.submit(generate, s.stub, prompt=p, params=greedy()) for p in TINY_PROMPTS}
        outputs = {p: f.result()[0] for p, f in futures.items()}
    assert outputs == {p: reference[p] for p in TINY_PROMPTS}
    assert s.stub.Stats(pb.StatsRequest()).preemptions_total > 0


def test_penalties_count_the_output_from_before_a_preemption(launch):
    """A preempted sequence prefills its output so far again: the target counts those tokens as
    output (frequency and presence penalties), so greedy output is what it is without preemption."""
    params = greedy()
    params.frequency_penalty, params.presence_penalty = 1.5, 0.5
    roomy = launch(eagle=False)
    expected = {p: generate(roomy.stub, prompt=p, params=params)[0] for p in TINY_PROMPTS}
    small = launch(eagle=False, target={"kv_cache_tokens": 160, "kv_page_size": 8})
    with ThreadPoolExecutor(8) as pool:
        futures = {p: pool.submit(generate, small.stub, prompt=p, params=params) for p in TINY_PROMPTS}
        outputs = {p: f.result()[0] for p, f in futures.items()}
    assert small.stub.Stats(pb.StatsRequest()).preemptions_total > 0
    assert outputs == expected


def test_an_unset_max_tokens_fits_a_small_kv_cache(launch):
    """The default max_tokens (1,024 within the context) stops where this deployment's cache
    can hold the sequence, instead of failing a request that fits with fewer."""
    s = launch(eagle=False, target={"kv_cache_tokens": 160, "kv_page_size": 8})
    params = pb.SamplingParams(temperature=0, ignore_eos=True)
    ids, _, _, last = generate(s.stub, prompt=TINY_PROMPTS[0], params=params)
    assert last.usage.prompt_tokens + len(ids) == 19 * 8  # 20 pages less one of headroom
