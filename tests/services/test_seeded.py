"""Seeded sampled requests through real target, draft and router servers: the output is a
function of the seed alone (position-keyed draws, tandem/sampling/keyed.py), whatever the
schedule did: drafts verified or not, speculation paused by the batch's size, a preemption and
resume, a plain deployment (token trees: tests/unit/test_keyed.py)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import generate_pb2 as pb
from tests.services.harness import generate
from tests.services.eagle_fixtures import tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.test_generate import sampled
from tests.services.test_trees_and_cache import generate_n, launch  # noqa: F401 (fixtures)

PROMPT = TINY_PROMPTS[1]


def seeded(seed=7, **kw):
    params = sampled(seed=seed, **kw)
    params.max_tokens = 48
    return params


def test_seeded_output_does_not_depend_on_drafts_batch_or_deployment(launch):
    # Speculation pauses while 2 sequences decode (the CPU default): alone the request drafts,
    # beside others it decodes plainly for some steps.
    s = launch(spec_draft_length=3, spec_disable_batch_size=2)
    alone, _, _, last = generate(s.stub, prompt=PROMPT, params=seeded())
    assert last.usage.draft_tokens > 0 and last.usage.accepted_draft_tokens > 0
    with ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(generate, s.stub, prompt=p, params=sampled()) for p in TINY_PROMPTS[2:5]]
        busy = generate(s.stub, prompt=PROMPT, params=seeded())[0]
        [f.result() for f in noise]
    off = generate(s.stub, prompt=PROMPT, params=seeded(speculate=False))[0]
    plain = launch(eagle=False)
    assert busy == off == alone == generate(plain.stub, prompt=PROMPT, params=seeded())[0]
    assert alone != generate(plain.stub, prompt=PROMPT, params=seeded(seed=8))[0]  # the seed matters


def test_seeded_children_equal_plain_ones(launch):
    tree = launch(spec_draft_length=3, max_num_sequence=16)
    plain = launch(eagle=False)
    out, usage = generate_n(tree.stub, 3, seeded(seed=11), prompt=PROMPT)
    assert usage.draft_tokens > 0
    assert out == generate_n(plain.stub, 3, seeded(seed=11), prompt=PROMPT)[0]


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
def test_a_preempted_seeded_sequence_resumes_to_the_same_output(launch, eagle):
    roomy = launch(eagle=False)
    expected = {p: generate(roomy.stub, prompt=p, params=seeded(seed=i))[0] for i, p in enumerate(TINY_PROMPTS)}
    small = launch(eagle=eagle, target={"kv_cache_tokens": 120, "kv_page_size": 8})
    with ThreadPoolExecutor(8) as pool:
        futures = {p: pool.submit(generate, small.stub, prompt=p, params=seeded(seed=i)) for i, p in enumerate(TINY_PROMPTS)}
        outputs = {p: f.result()[0] for p, f in futures.items()}
    assert small.stub.Stats(pb.StatsRequest()).preemptions_total > 0
    assert outputs == expected
