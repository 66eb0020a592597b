"""Sampled token trees verified under a grammar are lossless: through the real target engine (its
mask rows per tree node, its peer mailbox of draft probabilities, tree verification), the tokens
emitted after an EAGLE-shaped sampled tree follow the target's distribution masked by a small
choice grammar and renormalised, p', whatever the draft proposed, tokens outside the grammar
included.

Each of N sequences samples its first token t1 under the grammar, then verifies a tree drawn as a
sampled EAGLE tree is: two children of the root drawn without replacement from q0, one child of
the first drawn from q1. q0 and q1 put mass on tokens the grammar allows and on tokens it
refuses. The pairs (t1, first token the verify emits) must follow p'(t1) p'(t | t1)."""

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.ops import AddSequence, EntryKind, StepEntry, StepRequest
from tandem.peer import DraftProbs
from tandem.sampling.params import SamplingParams
from tandem.structured.spec import StructuredOutput
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from tests.services.test_structured_reference import allowed_of

N = 2000
PROMPT = "Pick one:"
SPEC = StructuredOutput("choice", ("ab", "ac", "ba", "ca", "cb", "cc", "cd", "dab"))
PARENTS = (0, 0, 1)  # nodes 1 and 2 children of the root (node 0 = t1), node 3 a child of node 1
REFUSED = (7, 11)  # token ids no choice starts with after any prefix here


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TargetEngine(TargetConfig(model_dir=tiny_model, kv_page_size=8, kv_cache_tokens=N * 8 * 3, max_num_sequence=N))


@pytest.fixture(scope="module")
def hf(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def masked_target(engine, hf, prompt_ids: list[int], prefix: list[int]) -> torch.Tensor:
    """p' after prompt + prefix: transformers' logits, the grammar's mask (a fresh llguidance
    matcher fed the prefix), softmax at temperature 1."""
    model, _ = hf
    matcher = engine.grammars.backend.compile(SPEC).template.deep_copy()
    assert matcher.consume_tokens(prefix)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + prefix])).logits[0, -1]
    allowed = allowed_of(matcher, logits.shape[0])
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)


def proposal(p: torch.Tensor) -> torch.Tensor:
    """A draft distribution unlike p: uniform over p's support and two refused tokens."""
    support = p.nonzero().flatten().tolist() + [t for t in REFUSED if p[t] == 0]
    q = torch.zeros_like(p)
    q[support] = 1 / len(support)
    return q


def test_a_sampled_tree_under_a_choice_grammar_emits_the_masked_target_distribution(engine, hf):
    prompt_ids = hf[1](PROMPT, add_special_tokens=False).input_ids
    params = SamplingParams(temperature=1.0, structured_output=SPEC)
    ops = tuple(AddSequence(i, SamplingParams(**{**_fields(params), "seed": 500 + i})) for i in range(N))
    prefill = tuple(StepEntry(i, EntryKind.PREFILL, tuple(prompt_ids), True) for i in range(N))
    first = {r.seq_id: r.tokens[0].token_id for r in engine.step(StepRequest(1, ops, prefill)).results}

    p1 = {a: masked_target(engine, hf, prompt_ids, [a]) for a in set(first.values())}
    p2 = {(a, d): masked_target(engine, hf, prompt_ids, [a, d]) for a in p1 for d in p1[a].nonzero().flatten().tolist()}
    gen = torch.Generator().manual_seed(3)
    probs, entries = {}, []
    for i, a in first.items():
        q0 = proposal(p1[a])
        d1, d2 = torch.multinomial(q0, 2, replacement=False, generator=gen).tolist()  # without replacement
        after = p2.get((a, d1))  # None: d1 is refused
        q1 = proposal(after) if after is not None else _uniform(q0.shape[0], REFUSED)
        d3 = int(torch.multinomial(q1, 1, generator=gen))
        probs[i] = torch.stack([q0, q1, torch.zeros_like(q0), torch.zeros_like(q0)])
        entries.append(StepEntry(i, EntryKind.DECODE, (a, d1, d2, d3), True, num_draft_tokens=3,
                                 tree_parents=PARENTS, sampled_tree=True))
    engine.peer.put_probs(DraftProbs(draft_step_id=1, probs=probs))
    results = engine.step(StepRequest(2, (), tuple(entries), draft_step_id=1)).results

    accepted = [r.num_accepted for r in results]
    assert 0 < sum(accepted) and min(accepted) == 0 and max(accepted) == 2  # accepted, recovered, deep paths
    for r in results:  # every emitted prefix stays inside the grammar
        matcher = engine.grammars.backend.compile(SPEC).template.deep_copy()
        assert matcher.consume_tokens([first[r.seq_id], *(t.token_id for t in r.tokens if t.token_id != 2)])
    joint = Counter((first[r.seq_id], r.tokens[0].token_id) for r in results)
    p0 = masked_target(engine, hf, prompt_ids, [])
    expected = {(a, b): p0[a].item() * p1[a][b].item() for a in p1 for b in p1[a].nonzero().flatten().tolist()}
    assert set(joint) <= set(expected)  # nothing outside the grammar, ever
    freq = {o: joint.get(o, 0) / N for o in expected}
    sigma = {o: math.sqrt(e * (1 - e) / N) for o, e in expected.items()}
    assert all(abs(freq[o] - e) <= 4 * sigma[o] + 1e-3 for o, e in expected.items()), (freq, expected)
    engine.reset()


def _uniform(vocab_size: int, tokens) -> torch.Tensor:
    q = torch.zeros(vocab_size)
    q[list(tokens)] = 1 / len(tokens)
    return q


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in SamplingParams.__dataclass_fields__ if f != "seed"}
