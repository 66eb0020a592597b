"""The EAGLE head shipped for the default model loads, keeps greedy output equal to the target
alone, and accepts far more than a random head on a handful of prompts (real model, in-process
services)."""

import pytest

from tandem.models.eagle_io import random_eagle_checkpoint
from tests.e2e.conftest import ROOT
from tests.services.harness import generate, start_services
from tests.services.test_generate import greedy

pytestmark = pytest.mark.slow

HEAD = ROOT / "heads" / "eagle-smollm2-135m"
PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Describe the water cycle in two sentences.", "List three tips for staying healthy."]


def accepted(model, head):
    s = start_services(model, draft_model=head, router={"spec_draft_length": 1})
    try:
        outputs, total = [], 0
        for prompt in PROMPTS:
            ids, _, _, last = generate(s.stub, messages=[{"role": "user", "content": prompt}], params=greedy(32))
            outputs.append(ids)
            total += last.usage.accepted_draft_tokens
        return outputs, total
    finally:
        s.stop()


def test_the_shipped_head_accepts_far_more_than_a_random_one(default_model, tmp_path):
    shipped, shipped_accepted = accepted(default_model, HEAD)
    random, random_accepted = accepted(default_model, random_eagle_checkpoint(tmp_path / "random", default_model, seed=1))
    assert shipped == random  # both equal the target alone: drafts never change greedy output
    assert shipped_accepted >= 10 and shipped_accepted > 3 * random_accepted, (shipped_accepted, random_accepted)
