"""Structured output keeps its constraint on every path where the target rebuilds a sequence's
grammar state from its output: a prefix-cache hit (the second request forks from the recycled
sequence, or from a prompt that holds an earlier output), a preempted sequence resumed with its
prompt + output, n > 1 children (some activated late for lack of slots), a target restarted
between requests. Real target, draft and router servers on the 1-layer tiny model with a
briefly trained EAGLE head; every output validates and greedy (and seeded) output equals the
uncached, unpreempted run's."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import generate_pb2 as pb
from tests.services.eagle_fixtures import tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.harness import generate
from tests.services.test_structured_output import SCHEMAS, choices_of
from tests.services.test_target_restart import restart_target
from tests.services.test_trees_and_cache import launch  # noqa: F401 (fixture)

SPECS = [
    pb.StructuredOutput(json_schema=json.dumps(SCHEMAS[2])),
    pb.StructuredOutput(json_schema=json.dumps(SCHEMAS[1])),
    pb.StructuredOutput(regex=r"(the|a) [a-z]{1,8}( [a-z]{1,8}){3,7}\."),  # long: it outgrows a small cache
    pb.StructuredOutput(choice=pb.Choices(values=["the weather is fine", "it rains all day", "snow"])),
]
LONG = [  # 30-60 tokens each: sequences that outgrow a small KV cache once admitted
    pb.StructuredOutput(regex=r"(the|a) [a-z]{3,8}( [a-z]{3,8}){6,9}\."),
    pb.StructuredOutput(json_schema=json.dumps({
        "type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                  "minItems": 5, "maxItems": 7}, "ok": {"type": "boolean"}},
        "required": ["tags", "ok"], "additionalProperties": False})),
    SPECS[0],
]


def check(so: pb.StructuredOutput, text: str) -> None:
    kind = so.WhichOneof("kind")
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(so.json_schema))
    elif kind == "regex":
        assert re.fullmatch(so.regex, text), text
    else:
        assert text in so.choice.values, text


def params(so, temperature=0.0, seed=None, n=1, max_tokens=80) -> pb.SamplingParams:
    p = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n, structured_output=so)
    if seed is not None:
        p.seed = seed
    return p


def run(s, so, **kw) -> tuple[dict[int, tuple[str, str]], pb.Usage]:
    """index -> (text, finish_reason), each checked against the spec; and the usage."""
    prompt = kw.pop("prompt", None)
    fields = {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": prompt}
    _, _, responses, last = generate(s.stub, params=params(so, **kw), **fields)
    out = choices_of(responses)
    for text, finish in out.values():
        assert finish == "stop", (so, text)
        check(so, text)
    return out, last.usage


def test_a_prefix_cache_hit_keeps_the_constraint(launch):  # noqa: F811
    cached, uncached = launch(), launch(eagle=False, prefix_cache_max_num_recycling_seqs=0)
    for i, so in enumerate(SPECS):
        prompt = TINY_PROMPTS[i]
        expected, _ = run(uncached, so, prompt=prompt)
        first, _ = run(cached, so, prompt=prompt)
        again, again_usage = run(cached, so, prompt=prompt)  # forks from the recycled sequence
        assert first == again == expected and again_usage.cached_prompt_tokens > 0
        seeded, _ = run(uncached, so, prompt=prompt, temperature=1.0, seed=i)
        assert run(cached, so, prompt=prompt, temperature=1.0, seed=i)[0] == seeded
        # A prompt that holds the first request's prompt and output: its KV is all cached, and its
        # grammar starts after its own prompt, not after the recycled sequence's.
        ids = generate(uncached.stub, prompt=prompt, params=params(so))[0]
        extended = tokens_of(cached, prompt) + ids[:-1]  # the output without its EOS
        hit, usage = run(cached, so, prompt=extended)
        assert usage.cached_prompt_tokens > len(ids) // 2
        assert hit == run(uncached, so, prompt=extended)[0]


def tokens_of(s, text: str) -> list[int]:
    return list(s.stub.Tokenize(pb.TokenizeRequest(prompt=text)).token_ids)


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
def test_a_preempted_sequence_resumes_inside_its_grammar(launch, eagle):  # noqa: F811
    roomy = launch(eagle=False)
    cases = [(p, LONG[i % len(LONG)]) for i, p in enumerate(TINY_PROMPTS)]
    expected = {p: run(roomy, so, prompt=p) for p, so in cases}
    seeded = {p: run(roomy, so, prompt=p, temperature=1.0, seed=i) for i, (p, so) in enumerate(cases)}
    small = launch(eagle=eagle, target={"kv_cache_tokens": 120, "kv_page_size": 8})
    before = small.stub.Stats(pb.StatsRequest()).preemptions_total
    # The load is the set-up, not the claim: on a busy machine the requests may come too far
    # apart to crowd the cache, so it runs again (outputs checked each time) until one was preempted.
    for _ in range(3):
        with ThreadPoolExecutor(len(cases)) as pool:
            greedy = {p: pool.submit(run, small, so, prompt=p) for p, so in cases}
            sampled = {p: pool.submit(run, small, so, prompt=p, temperature=1.0, seed=i) for i, (p, so) in enumerate(cases)}
            greedy = {p: f.result()[0] for p, f in greedy.items()}
            sampled = {p: f.result()[0] for p, f in sampled.items()}
        assert greedy == {p: out for p, (out, _) in expected.items()}
        assert sampled == {p: out for p, (out, _) in seeded.items()}
        if small.stub.Stats(pb.StatsRequest()).preemptions_total > before:
            break
    assert small.stub.Stats(pb.StatsRequest()).preemptions_total > before


def test_n_children_each_keep_the_constraint(launch):  # noqa: F811
    # k = 4: each speculating sequence counts 5 of max_num_sequence = 10, so two children run at
    # once and the third is activated by a later prefill.
    s, plain = launch(spec_draft_length=4, max_num_sequence=10), launch(eagle=False)
    for i, so in enumerate(SPECS):
        one, _ = run(plain, so, prompt=TINY_PROMPTS[i])
        three, usage = run(s, so, prompt=TINY_PROMPTS[i], n=3)
        assert three == {c: one[0] for c in range(3)}
        seeded, _ = run(s, so, prompt=TINY_PROMPTS[i], temperature=1.0, seed=7, n=3)
        assert seeded == run(plain, so, prompt=TINY_PROMPTS[i], temperature=1.0, seed=7, n=3)[0]
    assert usage.draft_tokens > 0


def test_a_target_restarted_between_requests_rebuilds_the_grammars(launch):  # noqa: F811
    s = launch(eagle=False, step_timeout_s=2.0)
    before = {i: (run(s, so, prompt=TINY_PROMPTS[i]), run(s, so, prompt=TINY_PROMPTS[i], temperature=1.0, seed=i))
              for i, so in enumerate(SPECS)}
    restart_target(s)  # a fresh engine: no matcher, no compiled grammar, an empty KV
    for i, so in enumerate(SPECS):
        assert run(s, so, prompt=TINY_PROMPTS[i])[0] == before[i][0][0]
        assert run(s, so, prompt=TINY_PROMPTS[i], temperature=1.0, seed=i)[0] == before[i][1][0]
    assert s.router_engine.figures.target_restarts == 1
