"""Constrained drafts served (tiny 1-layer target, a head trained on it in seconds): greedy text
the same with speculation on and off under constrained drafts (EAGLE chain here and Medusa chain
and tree; EAGLE trees in test_structured_speculation.py), constrained drafts accepting more
than unconstrained ones (--no-constrained-drafts) on JSON schemas, and forced tokens proposed
and accepted."""

import json

import jsonschema
import pytest

from tandem.models.medusa import random_medusa_checkpoint
from tandem.structured.drafting import DraftWalk
from tandem.v1 import generate_pb2 as pb
from tests.services.eagle_fixtures import tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.harness import generate, start_services
from tests.services.test_structured_output import SCHEMAS

PROMPTS = ["The weather today", "Describe it", "A cat and a dog", "Tell me"]
FIXED_KEYS = {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 8},
                                               "last_name": {"type": "string", "maxLength": 8},
                                               "city": {"enum": ["Paris", "Lima", "Oslo"]}},
              "required": ["first_name", "last_name", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stacks(tiny_model, trained_head):  # noqa: F811
    on = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4})
    off = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4},
                         draft={"constrained_drafts": False})
    yield {"constrained": on, "unconstrained": off}
    on.stop()
    off.stop()


def run(services, schema, prompt, speculate=True):
    so = pb.StructuredOutput(json_schema=json.dumps(schema))
    params = pb.SamplingParams(max_tokens=60, temperature=0, speculate=speculate, structured_output=so)
    ids, text, _, last = generate(services.stub, prompt=prompt, params=params)
    return ids, last.usage, text


def figures(services, schemas) -> tuple[list, dict]:
    outputs, totals = [], {"completion": 0, "drafted": 0, "accepted": 0}
    for schema in schemas:
        for prompt in PROMPTS:
            ids, usage, _ = run(services, schema, prompt)
            outputs.append(ids)
            totals["completion"] += usage.completion_tokens
            totals["drafted"] += usage.draft_tokens
            totals["accepted"] += usage.accepted_draft_tokens
    return outputs, totals


def test_constrained_drafts_accept_more_than_unconstrained_with_the_same_greedy_text(stacks):
    schemas = [*SCHEMAS, FIXED_KEYS]
    seen = {name: figures(s, schemas) for name, s in stacks.items()}
    plain = [run(stacks["constrained"], schema, prompt, speculate=False)[0] for schema in schemas for prompt in PROMPTS]
    assert seen["constrained"][0] == plain and seen["unconstrained"][0] == plain
    rate = {name: t["accepted"] / t["drafted"] for name, (_, t) in seen.items()}
    per_token = {name: t["accepted"] / t["completion"] for name, (_, t) in seen.items()}
    print(f"\nconstrained vs unconstrained drafts: {seen['constrained'][1]} vs {seen['unconstrained'][1]}")
    assert rate["constrained"] > rate["unconstrained"]
    assert per_token["constrained"] > per_token["unconstrained"]


def test_forced_tokens_are_drafted_and_accepted(stacks, monkeypatch):
    runs = []
    forced = DraftWalk.forced

    def recording(walk, limit):
        run = forced(walk, limit)
        runs.append(run)
        return run

    monkeypatch.setattr(DraftWalk, "forced", recording)
    _, usage, text = run(stacks["constrained"], FIXED_KEYS, "Tell me")
    assert sum(len(r) for r in runs) >= 6  # '{"first_name": "', '", "last_name": "', ...
    assert usage.accepted_draft_tokens >= 6
    jsonschema.validate(json.loads(text), FIXED_KEYS)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_medusa_greedy_is_the_same_with_constrained_drafts_on_and_off(tiny_model, tmp_path, shape):  # noqa: F811
    heads = random_medusa_checkpoint(tmp_path / "medusa", tiny_model, num_heads=3, seed=1)
    s = start_services(tiny_model, draft_model=heads, draft_method="medusa", draft={"shape": shape})
    try:
        for schema in (SCHEMAS[0], FIXED_KEYS):
            spec, usage, _ = run(s, schema, "Tell me")
            plain, _, _ = run(s, schema, "Tell me", speculate=False)
            assert spec == plain and usage.draft_tokens > 0 and usage.accepted_draft_tokens > 0
    finally:
        s.stop()


def test_a_sequence_that_decoded_without_drafts_first_drafts_inside_its_grammar(tiny_model, trained_head, caplog):  # noqa: F811
    """Paused beside a second stream (--spec-disable-batch-size 2), a constrained sequence's first
    steps draft nothing; once alone it drafts, and the draft knows where its output starts (the
    router's num_prompt_tokens) rather than guessing it from its first drafted call."""
    from concurrent.futures import ThreadPoolExecutor

    s = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4, "spec_disable_batch_size": 2})
    try:
        so = pb.StructuredOutput(json_schema=json.dumps(FIXED_KEYS))
        constrained = pb.SamplingParams(max_tokens=60, temperature=0, structured_output=so)
        other = pb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        with ThreadPoolExecutor(2) as pool, caplog.at_level("INFO", logger="draft_service.grammars"):
            beside = pool.submit(generate, s.stub, prompt=PROMPTS[1], params=other)
            ids, text, _, last = pool.submit(generate, s.stub, prompt=PROMPTS[0], params=constrained).result()
            beside.result()
        jsonschema.validate(json.loads(text), FIXED_KEYS)
        assert last.usage.draft_tokens > 0 and last.usage.accepted_draft_tokens > 0
        assert not [r for r in caplog.records if "outside its grammar" in r.getMessage()]
    finally:
        s.stop()
