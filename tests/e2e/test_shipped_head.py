"""The heads shipped for the default model (EAGLE and Medusa) load, keep greedy output equal to
the target alone, and accept far more than a random head of the same method on a handful of
prompts (real model, in-process services)."""

import pytest

from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.models.medusa import random_medusa_checkpoint
from tests.e2e.conftest import ROOT
from tests.services.harness import generate, start_services
from tests.services.test_generate import greedy

pytestmark = pytest.mark.slow

HEADS = {"eagle": ROOT / "heads" / "eagle-smollm2-135m", "medusa": ROOT / "heads" / "medusa-smollm2-135m"}
PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Describe the water cycle in two sentences.", "List three tips for staying healthy."]


def accepted(model, head, method):
    draft = {"shape": "chain"}  # one draft token a step: depth-1 acceptance, the head's first skill
    s = start_services(model, draft_model=head, draft_method=method, draft=draft, router={"spec_draft_length": 1})
    try:
        outputs, total = [], 0
        for prompt in PROMPTS:
            ids, _, _, last = generate(s.stub, messages=[{"role": "user", "content": prompt}], params=greedy(32))
            outputs.append(ids)
            total += last.usage.accepted_draft_tokens
        return outputs, total
    finally:
        s.stop()


def random_head(method, folder, model):
    if method == "eagle":
        return random_eagle_checkpoint(folder, model, seed=1)
    return random_medusa_checkpoint(folder, model, num_heads=3, seed=1, own_lm_head=False)


@pytest.mark.parametrize("method", sorted(HEADS))
def test_the_shipped_head_accepts_far_more_than_a_random_one(method, default_model, tmp_path):
    shipped, shipped_accepted = accepted(default_model, HEADS[method], method)
    random, random_accepted = accepted(default_model, random_head(method, tmp_path / "random", default_model), method)
    assert shipped == random  # both equal the target alone: drafts never change greedy output
    assert shipped_accepted >= 10 and shipped_accepted > 3 * random_accepted, (shipped_accepted, random_accepted)
