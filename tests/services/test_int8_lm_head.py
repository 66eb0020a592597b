"""EAGLE with the draft's lm_head in int8 (`--draft-lm-head-quant int8`, the CPU default of
`tandem up`), and its own projections too (`--draft-head-quant int8`), through real target, draft and router servers on the tiny model: drafts only
propose, so greedy output still equals the target's token for token, the trained head still
accepts, and a seeded sampled request is the same alone and in a mixed batch (an int8 row's
scores do not depend on the rest of the batch)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.testing.tiny import TINY_PROMPTS
from tests.services.eagle_fixtures import reference, tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.harness import generate, start_services
from tests.services.test_generate import greedy, sampled


@pytest.fixture(scope="module", params=["lm_head", "lm_head and layer"])
def eagle_int8(request, tiny_model, trained_head):
    quant = {"lm_head_quant": "int8"} | ({"head_quant": "int8"} if request.param != "lm_head" else {})
    s = start_services(tiny_model, draft_model=trained_head, draft=quant, router={"spec_draft_length": 4})
    yield s
    s.stop()


def test_int8_lm_head_is_used_and_greedy_equals_target(eagle_int8, reference):
    head = eagle_int8.draft_engine.head
    assert type(head.lm_head).__name__ == "Int8Linear"
    int8_layer = eagle_int8.draft_engine.config.head_quant == "int8"
    assert (type(head.fc).__name__ == type(head.layers[0].gate_up).__name__ == "Int8Linear") == int8_layer
    drafted = accepted = 0
    with ThreadPoolExecutor(len(TINY_PROMPTS)) as pool:
        results = list(pool.map(lambda p: generate(eagle_int8.stub, prompt=p, params=greedy()), TINY_PROMPTS))
    for prompt, (ids, _, _, last) in zip(TINY_PROMPTS, results):
        assert ids == reference[prompt], prompt
        drafted += last.usage.draft_tokens
        accepted += last.usage.accepted_draft_tokens
    # As the fp32 head (tests/services/test_eagle.py); int8 projections in its layer cost this
    # tiny head (hidden size 64) a little: 0.22 of its drafts accepted with an int8 lm_head, 0.20
    # with its layer in int8 too.
    assert drafted > 0 and accepted / drafted > (0.2 if not int8_layer else 0.15)


def test_int8_seeded_speculative_sampling_reproducible_in_any_batch(eagle_int8):
    prompt = TINY_PROMPTS[1]
    alone = generate(eagle_int8.stub, prompt=prompt, params=sampled(seed=77))
    assert alone[3].usage.draft_tokens > 0
    jobs = [(prompt, sampled(seed=77))] + [(TINY_PROMPTS[i], sampled(seed=i)) for i in range(5)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda j: generate(eagle_int8.stub, prompt=j[0], params=j[1])[0], jobs))
    assert mixed[0] == alone[0]
