"""Speculative sampling is lossless: through the real target engine (its verify step and its
peer mailbox of draft probabilities), the tokens emitted after verifying drafts drawn from a
different distribution q follow the target's own distribution."""

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.ops import AddSequence, EntryKind, StepEntry, StepRequest
from tandem.peer import DraftProbs
from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import probabilities, process_logits
from tandem.sampling.state import SamplingState
from target_service.config import TargetConfig
from target_service.engine import TargetEngine

N = 3000
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TargetEngine(TargetConfig(model_dir=tiny_model, kv_page_size=8, kv_cache_tokens=N * 8 * 2, max_num_sequence=N))


@pytest.fixture(scope="module")
def hf(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def exact(hf, prompt_ids, prefix, params) -> torch.Tensor:
    """The target's own next-token distribution after prompt + prefix, processed like the target."""
    model, _ = hf
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + prefix])).logits[0, -1:]
    state = SamplingState(params, logits.shape[-1])
    return probabilities(process_logits(logits, [state]), [state])[0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.8),
], ids=["t0.7", "t1.3", "top_p0.8"])
def test_tokens_after_verification_follow_the_target(engine, hf, params):
    prompt_ids, first = prefill_many(engine, hf, params, seed=1000)

    # Drafts from q: uniform over a few ids, overlapping the target's likely tokens but not equal.
    vocab = engine.model.config.vocab_size
    p1 = {t: exact(hf, prompt_ids, [t], params) for t in set(first.values())}
    gen = torch.Generator().manual_seed(5)
    q, drafts = {}, {}
    for i, t1 in first.items():
        support = p1[t1].topk(3).indices.tolist() + [7, 11]
        row = torch.zeros(vocab)
        row[support] = 1 / len(support)
        drafts[i] = support[int(torch.randint(len(support), (1,), generator=gen))]
        q[i] = row[None]
    engine.peer.put_probs(DraftProbs(draft_step_id=1, probs=q))
    verify = tuple(StepEntry(i, EntryKind.DECODE, (first[i], drafts[i]), True, num_draft_tokens=1) for i in range(N))
    results = engine.step(StepRequest(2, (), verify, draft_step_id=1)).results
    accepted = sum(r.num_accepted for r in results)
    assert 0 < accepted < N  # both branches (accepted, recovered) were exercised
    assert_first_two_follow_the_target(hf, prompt_ids, params, first, p1, results)
    assert engine.stats().sequences_live == N
    engine.reset()
    assert engine.stats().kv_pages_free == engine.stats().kv_pages_total


def prefill_many(engine, hf, params: SamplingParams, seed: int) -> tuple[list[int], dict[int, int]]:
    """N sequences of PROMPT, sequence i seeded seed + i, prefilled in one step: (prompt ids,
    seq_id -> its first sampled token)."""
    engine.reset()
    prompt_ids = hf[1](PROMPT)["input_ids"]
    ops = tuple(AddSequence(i, SamplingParams(**{**_fields(params), "seed": seed + i})) for i in range(N))
    prefill = tuple(StepEntry(i, EntryKind.PREFILL, tuple(prompt_ids), True) for i in range(N))
    return prompt_ids, {r.seq_id: r.tokens[0].token_id for r in engine.step(StepRequest(1, ops, prefill)).results}


def assert_first_two_follow_the_target(hf, prompt_ids, params, first, p1, results) -> None:
    """The pairs (first token, the verify step's first token) follow the target's joint
    distribution, p1[a] being the target's distribution after first token a."""
    joint = Counter((first[r.seq_id], r.tokens[0].token_id) for r in results)
    p0 = exact(hf, prompt_ids, [], params)
    expected = {(a, b): p0[a].item() * p1[a][b].item() for a in p1 for b in p1[a].nonzero().flatten().tolist()}
    outcomes = set(expected) | set(joint)
    tv = 0.5 * sum(abs(joint.get(o, 0) / len(results) - expected.get(o, 0.0)) for o in outcomes)
    bound = 3 * math.sqrt(len(expected) / len(results))
    assert tv < bound, (tv, bound)


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in SamplingParams.__dataclass_fields__ if f != "seed"}
