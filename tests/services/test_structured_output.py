"""Structured output through real target and router servers on a tiny random model: outputs
that validate against their JSON schemas, regexes and choices that match, n = 2, the masked
first-token distribution, bad specs refused naming the field while the service stays up."""

import json
import re
from collections import Counter

import grpc
import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.v1 import generate_pb2 as pb
from tests.services.harness import generate

COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # short outputs from a random model
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 9}},
                                                "required": ["x"], "additionalProperties": False},
                                      "kind": {"enum": ["a", "b"]}}, "required": ["inner", "kind"], "additionalProperties": False},
]


def choices_of(responses) -> dict[int, tuple[str, str]]:
    """index -> (text, finish_reason)."""
    text, finish = {}, {}
    for r in responses:
        for c in r.choices:
            text[c.index] = text.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index, "")
    return {i: (text[i], finish[i]) for i in text}


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "array-enum", "nested-number"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_outputs_validate_against_their_schema(services, schema, temperature):
    so = pb.StructuredOutput(json_schema=json.dumps({**schema, **COMPACT}))
    params = pb.SamplingParams(max_tokens=120, temperature=temperature, seed=3, n=2, structured_output=so)
    _, _, responses, _ = generate(services.stub, prompt="Describe it", params=params)
    for text, finish in choices_of(responses).values():
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice_outputs_match(services):
    cases = [
        (pb.StructuredOutput(regex=r"[a-c]{2,5}-[0-9]"), lambda t: re.fullmatch(r"[a-c]{2,5}-[0-9]", t)),
        (pb.StructuredOutput(choice=pb.Choices(values=["yes", "no", "maybe so"])), lambda t: t in ("yes", "no", "maybe so")),
        (pb.StructuredOutput(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]/'), lambda t: re.fullmatch(r"\([0-9](,[0-9])*\)", t)),
        (pb.StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for so, ok in cases:
        for temperature in (0.0, 1.0):
            params = pb.SamplingParams(max_tokens=200, temperature=temperature, seed=1, structured_output=so)
            _, text, responses, _ = generate(services.stub, prompt="Answer:", params=params)
            finish = choices_of(responses)[0][1]
            if so.WhichOneof("kind") == "json_object" and finish == "length":
                continue  # a random model's free-form object may outrun max_tokens
            assert finish == "stop" and ok(text), (so, text, finish)


def test_max_tokens_first_ends_the_choice_with_length(services):
    so = pb.StructuredOutput(regex=r"[a-z]{20}")
    _, text, responses, _ = generate(services.stub, prompt="x", params=pb.SamplingParams(max_tokens=3, temperature=0, structured_output=so))
    assert choices_of(responses)[0][1] == "length" and re.fullmatch(r"[a-z]*", text)


@pytest.mark.parametrize("so, field", [
    (pb.StructuredOutput(json_schema='{"type": "nope"}'), "params.structured_output.json_schema"),
    (pb.StructuredOutput(json_schema="{not json"), "params.structured_output.json_schema"),
    (pb.StructuredOutput(regex="a(b"), "params.structured_output.regex"),
    (pb.StructuredOutput(grammar="start: missing_rule"), "params.structured_output.grammar"),
    (pb.StructuredOutput(choice=pb.Choices(values=[])), "params.structured_output.choice"),
])
def test_a_bad_spec_is_invalid_argument_naming_the_field(services, so, field):
    with pytest.raises(grpc.RpcError) as e:
        generate(services.stub, prompt="hi", params=pb.SamplingParams(max_tokens=4, structured_output=so))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()
    _, text, _, _ = generate(services.stub, prompt="hi", params=pb.SamplingParams(
        max_tokens=4, temperature=0, structured_output=pb.StructuredOutput(choice=pb.Choices(values=["ok"]))))
    assert text == "ok"  # still serving


CHOICES = ["a", "b", "c", "d"]  # one token each in the tiny tokenizer


def test_sampled_choices_follow_the_masked_target_distribution(services, tiny_model):
    """The first token, drawn under the choice grammar's mask, follows the target's distribution
    restricted to the allowed tokens and renormalised (transformers' logits, masked here)."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = tok("Pick one:", add_special_tokens=False).input_ids
    ids = [tok(c, add_special_tokens=False).input_ids for c in CHOICES]
    assert all(len(i) == 1 for i in ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    expected = torch.softmax(logits[[i[0] for i in ids]], -1)
    so = pb.StructuredOutput(choice=pb.Choices(values=CHOICES))
    counts: Counter = Counter()
    for seed in range(6):
        params = pb.SamplingParams(max_tokens=2, temperature=1.0, n=50, seed=seed, structured_output=so)
        _, _, responses, _ = generate(services.stub, token_ids=prompt, params=params)
        counts.update(text for text, _ in choices_of(responses).values())
    n = sum(counts.values())
    assert set(counts) <= set(CHOICES)
    freq = torch.tensor([counts[c] / n for c in CHOICES])
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= 4 * sigma + 1e-3).all(), (freq, expected)
