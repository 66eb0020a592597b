"""Masked sampling and masked verification on small tensors: greedy takes the masked argmax,
draws and keyed draws stay inside the mask, a draft outside the grammar is always rejected, and
chain verification's output follows the masked, renormalised target distribution."""

import torch

from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import masked, sample
from tandem.sampling.state import SamplingState
from tandem.sampling.verify import verify_chain

V = 6


def state(**kw):
    return SamplingState(SamplingParams(**kw), V)


def test_masked_sets_refused_tokens_to_minus_infinity():
    logits = torch.arange(V, dtype=torch.float32)[None]
    allowed = torch.tensor([[True, False, True, False, False, False]])
    out = masked(logits, allowed)
    assert out[0, 0] == 0 and out[0, 2] == 2 and torch.isinf(out[0, 1]) and masked(logits, None) is logits


def test_greedy_sample_is_the_masked_argmax_with_raw_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 0.5, 0.1]])
    allowed = torch.tensor([[True, False, True, False, True, False]])
    out = sample(logits, [state(temperature=0)], [0], allowed)
    assert out.token_ids == [2]
    assert abs(out.logprobs[0] - float(torch.log_softmax(logits, -1)[0, 2])) < 1e-6


def test_sampled_and_keyed_draws_stay_inside_the_mask():
    logits = torch.zeros(1, V)
    allowed = torch.tensor([[False, True, False, True, False, False]])
    s, keyed = state(seed=1), state(seed=7, keyed_draws=True, top_k=4)
    for i in range(200):
        assert sample(logits, [s], [i], allowed).token_ids[0] in (1, 3)
        assert sample(logits, [keyed], [i], allowed).token_ids[0] in (1, 3)


def test_greedy_verify_accepts_only_the_masked_argmax():
    logits = torch.tensor([[0.0, 9.0, 3.0, 0, 0, 0], [0, 0, 0, 9.0, 1.0, 0], [1.0, 0, 0, 0, 0, 0]])
    allowed = torch.ones(3, V, dtype=torch.bool)
    allowed[0, 1] = False  # the raw argmax 1 is outside the grammar: 2 is the masked one
    r = verify_chain(logits, [1, 3], None, state(temperature=0), 0, allowed)
    assert r.num_accepted == 0 and [t.token_id for t in r.tokens] == [2]
    r = verify_chain(logits, [2, 3], None, state(temperature=0), 0, allowed)
    assert r.num_accepted == 2 and [t.token_id for t in r.tokens] == [2, 3, 0]


def test_a_draft_outside_the_grammar_is_always_rejected_even_when_the_draft_is_sure():
    logits = torch.zeros(2, V)
    allowed = torch.ones(2, V, dtype=torch.bool)
    allowed[0, 4] = False
    q = torch.zeros(1, V)
    q[0, 4] = 1.0
    s = state(seed=3)
    for _ in range(100):
        r = verify_chain(logits, [4], q, s, 0, allowed)
        assert r.num_accepted == 0 and r.tokens[0].token_id != 4


def test_sampled_chain_verification_follows_the_masked_target():
    """Two positions: the emitted first token is distributed as p' (the masked, renormalised
    target) whatever the draft's q, here a q that likes a refused token most."""
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.5, 0.0, 2.0, -1.0, 0.3], [0.0] * V])
    allowed = torch.tensor([[True, True, True, False, False, False], [True] * V])
    p = torch.softmax(masked(logits, allowed)[0], -1)
    q = torch.tensor([[0.1, 0.1, 0.1, 0.6, 0.1, 0.0]])
    s = state(seed=11)
    n = 2000
    counts = torch.zeros(V)
    gen = torch.Generator().manual_seed(5)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        counts[verify_chain(logits, [d], q, s, 0, allowed).tokens[0].token_id] += 1
    freq = counts / n
    assert freq[3:].sum() == 0
    assert (freq - p).abs().max() < 0.045, (freq, p)  # 4 sigma at n = 2000
