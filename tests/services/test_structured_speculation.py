"""Structured output under EAGLE speculation (chains, and the CPU's tree shape): greedy text the
same with speculation on and off and for each of n = 2 choices, drafts offered and verified
against the masked target, every output inside its grammar."""

import json
import re

import jsonschema
import pytest

from tandem.v1 import generate_pb2 as pb
from tests.services.eagle_fixtures import tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.harness import generate, start_services
from tests.services.test_structured_output import COMPACT, SCHEMAS, choices_of

SPECS = [
    pb.StructuredOutput(json_schema=json.dumps({**SCHEMAS[0], **COMPACT})),
    pb.StructuredOutput(json_schema=json.dumps({**SCHEMAS[2], **COMPACT})),
    pb.StructuredOutput(regex=r"(the|a) [a-z]{1,8}( [a-z]{1,8}){2,5}\."),
]


@pytest.fixture(scope="module", params=["chain", "tree"])
def services(request, tiny_model, trained_head):  # noqa: F811
    draft = {"shape": "tree", "tree_top_k": 2, "tree_node_budget": 4} if request.param == "tree" else None
    s = start_services(tiny_model, draft_model=trained_head, router={"spec_draft_length": 4}, draft=draft)
    yield s
    s.stop()


def run(services, so, speculate, temperature=0.0, n=1, seed=None):
    params = pb.SamplingParams(max_tokens=80, temperature=temperature, speculate=speculate, n=n, structured_output=so)
    if seed is not None:
        params.seed = seed
    _, _, responses, last = generate(services.stub, prompt="The weather today", params=params)
    return choices_of(responses), last.usage


def check(so, text):
    if so.WhichOneof("kind") == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(so.json_schema))
    else:
        assert re.fullmatch(so.regex, text), text


@pytest.mark.parametrize("so", SPECS, ids=["flat", "nested", "regex"])
def test_greedy_is_the_same_with_speculation_on_and_off_and_for_n_2(services, so):
    plain, plain_usage = run(services, so, speculate=False)
    spec, usage = run(services, so, speculate=True)
    assert plain_usage.draft_tokens == 0 and usage.draft_tokens > 0
    assert spec == plain
    text, finish = plain[0]
    assert finish == "stop"
    check(so, text)
    two, _ = run(services, so, speculate=True, n=2)
    assert two == {0: plain[0], 1: plain[0]}


@pytest.mark.parametrize("so", SPECS, ids=["flat", "nested", "regex"])
def test_sampled_and_seeded_outputs_stay_in_the_grammar_under_speculation(services, so):
    for seed in (None, 5):
        out, usage = run(services, so, speculate=True, temperature=1.0, n=3, seed=seed)
        assert usage.draft_tokens > 0
        for text, finish in out.values():
            if finish == "stop":
                check(so, text)
    seeded_plain, _ = run(services, so, speculate=False, temperature=1.0, seed=9)
    seeded_spec, _ = run(services, so, speculate=True, temperature=1.0, seed=9)
    assert seeded_spec == seeded_plain  # keyed draws: the same text however it was drafted
