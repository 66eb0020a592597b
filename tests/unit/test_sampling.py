"""Unit tests of tandem.sampling: validation, logit processing, filters, draws, determinism."""

import math

import pytest
import torch

from tandem.errors import FailedPrecondition, InvalidArgument
from tandem.sampling import sampler
from tandem.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from tandem.sampling.sampler import (draw_without_replacement, probabilities, process_logits, received_proposal, sample,
                                     wire_proposal)
from tandem.sampling.state import SamplingState

V = 8


def state(vocab_size: int = V, **kwargs) -> SamplingState:
    return SamplingState(SamplingParams(**kwargs), vocab_size)


def log_probs_row(probs: list[float]) -> torch.Tensor:
    """A [1, V] logits row whose softmax is `probs`."""
    return torch.tensor([probs]).log()


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -1),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("presence_penalty", 3.0),
        ("presence_penalty", -2.01),
        ("top_logprobs", -1),
        ("top_logprobs", MAX_TOP_LOGPROBS + 1),
        ("seed", -1),
        ("seed", 2**64),
    ],
)
def test_validate_names_the_field_and_value(field, value):
    with pytest.raises(InvalidArgument, match=rf"params\.{field}") as info:
        SamplingParams(**{field: value}).validate(vocab_size=V)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    "bias, bad", [(((V, 1.0),), repr(V)), (((-1, 1.0),), "-1"), (((3, math.inf),), "inf")]
)
def test_validate_logit_bias(bias, bad):
    with pytest.raises(InvalidArgument, match=r"params\.logit_bias") as info:
        SamplingParams(logit_bias=bias).validate(vocab_size=V)
    assert bad in str(info.value)


def test_validate_accepts_edges():
    SamplingParams().validate(V)
    SamplingParams(
        temperature=0.0, top_p=1.0, top_k=V + 5, min_p=1.0, repetition_penalty=0.5,
        frequency_penalty=-2.0, presence_penalty=2.0, logit_bias=((0, -100.0), (V - 1, 5.0)),
        seed=2**64 - 1, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS,
    ).validate(V)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy


# --- logit processing -------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 0.0, 0.0, 6.0]])
    states = [state(4, temperature=0.0), state(4, temperature=0.0)]
    result = sample(logits, states)
    assert result.token_ids == [1, 3]  # ties: lowest id
    probs = probabilities(process_logits(logits, states), states)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]


def test_logit_bias_forces_a_token():
    logits = torch.tensor([[3.0, 1.0, 0.0, -2.0]])
    s = state(4, temperature=0.0, logit_bias=((3, 100.0),))
    assert sample(logits, [s]).token_ids == [3]
    s = state(4, temperature=1.0, seed=1, logit_bias=((0, -100.0), (3, 100.0)))
    assert all(sample(logits, [s]).token_ids == [3] for _ in range(20))


def test_repetition_penalty_lowers_seen_token():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.25]])
    s = state(4, temperature=0.0, repetition_penalty=2.0)
    s.observe_prompt([0, 2])
    out = process_logits(logits, [s])
    assert out.tolist() == [[1.0, 1.5, -2.0, -1.25]]  # positive halved, negative doubled
    assert out[0, 0] < out[0, 1] and out[0, 2] < out[0, 3]  # seen below the unseen neighbour
    assert sample(logits, [s]).token_ids == [1]


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1e-40), dict(logit_bias=((1, 1e39),))])
def test_valid_extremes_that_overflow_still_draw(kw):
    """A seen positive logit divided by a tiny repetition penalty, or a huge bias, overflows
    float32 to +inf; the row still draws (that token), and a neighbour row is untouched."""
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.25], [0.0, 0.0, 5.0, 0.0]])
    extreme, plain = state(4, seed=3, **kw), state(4, temperature=0.0)
    extreme.observe_prompt([1])
    probs = probabilities(process_logits(logits, [extreme, plain]), [extreme, plain])
    assert torch.isfinite(probs).all() and probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert sample(logits, [extreme, plain]).token_ids == [1, 2]


def test_a_resumed_prefill_counts_its_output_tokens():
    """Tokens prefilled past num_prompt_tokens (a sequence resumed after preemption) are output:
    counted, as if sampled, whichever chunk they come in."""
    resumed = SamplingState(SamplingParams(frequency_penalty=1.0), 8, num_prompt_tokens=3)
    resumed.observe_prefill(0, [1, 2])
    resumed.observe_prefill(2, [3, 4, 4, 5])
    assert resumed.output_counts.tolist() == [0, 0, 0, 0, 2, 1, 0, 0]
    assert resumed.seen.nonzero().flatten().tolist() == [1, 2, 3, 4, 5]
    fresh = state(8, frequency_penalty=1.0)
    fresh.observe_prefill(0, [1, 2, 4])
    assert not fresh.output_counts.any() and fresh.seen.sum() == 3


def test_frequency_and_presence_arithmetic():
    logits = torch.zeros(1, 4)
    s = state(4, frequency_penalty=0.5, presence_penalty=0.25)
    s.observe_prompt([3])  # prompt tokens carry no frequency/presence penalty
    for t in (1, 1, 1, 2):
        s.observe_output(t)
    out = process_logits(logits, [s])
    assert out.tolist() == [[0.0, -(0.5 * 3 + 0.25), -(0.5 * 1 + 0.25), 0.0]]


def test_process_logits_upcasts_and_leaves_plain_rows_alone():
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    s = state(2, repetition_penalty=2.0)
    s.observe_prompt([1])
    out = process_logits(logits, [state(2), s])
    assert out.dtype == torch.float32 and out.tolist() == [[1.0, 2.0], [3.0, 2.0]]
    assert logits.tolist() == [[1.0, 2.0], [3.0, 4.0]]  # input untouched


# --- filters ----------------------------------------------------------------------------------


def test_top_k_1_equals_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    greedy = sample(logits, [state(50, temperature=0.0) for _ in range(6)]).token_ids
    top1 = [state(50, temperature=1.3, top_k=1, seed=i) for i in range(6)]
    assert sample(logits, top1).token_ids == greedy


def test_top_k_keeps_k_highest():
    logits = log_probs_row([0.1, 0.4, 0.2, 0.3])
    s = state(4, top_k=2)
    probs = probabilities(process_logits(logits, [s]), [s])
    assert torch.allclose(probs, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))


def test_top_p_keeps_the_expected_set():
    logits = log_probs_row([0.05, 0.5, 0.15, 0.3])
    expected = {
        0.4: [0.0, 1.0, 0.0, 0.0],  # the top token alone reaches 0.4
        0.75: [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8],  # 0.5 + 0.3 reaches 0.75
        0.9: [0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95],
        1.0: [0.05, 0.5, 0.15, 0.3],
    }
    for top_p, want in expected.items():
        s = state(4, top_p=top_p)
        probs = probabilities(process_logits(logits, [s]), [s])
        assert torch.allclose(probs, torch.tensor([want]), atol=1e-6), top_p


def test_min_p_drops_tokens_below_ratio_of_max():
    logits = log_probs_row([0.05, 0.5, 0.15, 0.3])
    s = state(4, min_p=0.25)  # threshold 0.125: drops 0.05 only
    probs = probabilities(process_logits(logits, [s]), [s])
    assert torch.allclose(probs, torch.tensor([[0.0, 0.5, 0.15, 0.3]]) / 0.95, atol=1e-6)


def test_temperature_sharpens():
    logits = torch.tensor([[0.0, math.log(2.0)]])
    s = state(2, temperature=0.5)  # p ~ exp(2 * logit): 1 : 4
    probs = probabilities(process_logits(logits, [s]), [s])
    assert torch.allclose(probs, torch.tensor([[0.2, 0.8]]))


def test_probability_rows_sum_to_one():
    torch.manual_seed(1)
    logits = torch.randn(6, 100) * 3
    states = [
        state(100), state(100, temperature=0.0), state(100, top_k=5, temperature=0.7),
        state(100, top_p=0.5), state(100, min_p=0.1, top_p=0.9, top_k=20),
        state(100, temperature=1e-6),
    ]
    probs = probabilities(process_logits(logits, states), states)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(6))
    assert not probs.isnan().any() and (probs >= 0).all()


# --- draws, determinism and the output distribution ------------------------------------------


def test_same_seed_same_draws_alone_or_batched():
    torch.manual_seed(2)
    row = torch.randn(64)
    alone_state = state(64, seed=42, top_p=0.95)
    alone = [sample(row[None], [alone_state]).token_ids[0] for _ in range(30)]
    for position in (0, 2, 3):
        logits = torch.randn(4, 64)
        logits[position] = row
        batch = [state(64, seed=100 + i) for i in range(4)]  # other rows: other seeds
        batch[position] = state(64, seed=42, top_p=0.95)
        got = [sample(logits, batch).token_ids[position] for _ in range(30)]
        assert got == alone, position


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    a, b = state(1000, seed=1), state(1000, seed=2)
    seq_a = [sample(logits, [a]).token_ids[0] for _ in range(10)]
    seq_b = [sample(logits, [b]).token_ids[0] for _ in range(10)]
    assert seq_a != seq_b
    c = state(1000, seed=1)
    assert [sample(logits, [c]).token_ids[0] for _ in range(10)] == seq_a


def test_empirical_distribution_matches_probabilities():
    n, batch = 20_000, 2_000
    logits = log_probs_row([0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02])
    s = state(V, temperature=1.0, top_p=0.9, seed=7)
    p = probabilities(process_logits(logits, [s]), [s])[0]
    assert (p[6:] == 0).all() and p[5] > 0  # top-p 0.9 drops the 0.04 and 0.02 tail
    counts = torch.zeros(V)
    for _ in range(n // batch):
        tokens = sample(logits.expand(batch, V), [s] * batch).token_ids
        counts += torch.bincount(torch.tensor(tokens), minlength=V)
    tv = 0.5 * (counts / n - p).abs().sum().item()
    assert tv < 3 * math.sqrt(V / n), tv
    assert counts[6:].sum() == 0


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    raw = torch.log_softmax(logits, dim=-1)[0]
    s = state(4, temperature=0.0, repetition_penalty=2.0, logit_bias=((0, 10.0),), top_logprobs=3)
    result = sample(logits, [s])
    assert result.token_ids == [0]
    assert result.logprobs == pytest.approx([raw[0].item()])
    assert [t for t, _ in result.top_logprobs[0]] == [1, 2, 0]
    assert [lp for _, lp in result.top_logprobs[0]] == pytest.approx(raw[[1, 2, 0]].tolist())


def test_top_logprobs_per_row():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    states = [state(4, temperature=0.0), state(4, temperature=0.0, top_logprobs=2)]
    result = sample(logits, states)
    assert result.top_logprobs[0] == []
    assert [t for t, _ in result.top_logprobs[1]] == [2, 3]
    assert len(result.logprobs) == 2 and all(lp <= 0 for lp in result.logprobs)


# --- state ------------------------------------------------------------------------------------


def test_bookkeeping_only_with_penalties():
    plain = state()
    assert not plain.needs_penalties and plain.seen is None and plain.output_counts is None
    plain.observe_prompt([1, 2])
    plain.observe_output(3)  # no-ops
    assert state(presence_penalty=0.1).needs_penalties


def test_fork_copies_bookkeeping():
    parent = state(repetition_penalty=1.5, frequency_penalty=0.5, seed=3)
    parent.observe_prompt([1, 2])
    parent.observe_output(5)
    child = parent.fork(SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, seed=4))
    assert torch.equal(child.seen, parent.seen)
    assert torch.equal(child.output_counts, parent.output_counts)
    child.observe_output(6)
    assert not parent.seen[6] and parent.output_counts[6] == 0
    assert child.seen[6] and child.output_counts[6] == 1
    assert child.generator is not parent.generator and child.generator.initial_seed() == 4


def test_fork_needs_parent_bookkeeping_for_penalties():
    parent = state(seed=3)
    assert parent.fork(SamplingParams(seed=4)).seen is None
    with pytest.raises(FailedPrecondition, match="fork"):
        parent.fork(SamplingParams(presence_penalty=0.5))


def test_unseeded_states_get_their_own_streams():
    a, b = state(), state()
    assert a.generator.initial_seed() != b.generator.initial_seed()


@pytest.mark.parametrize("distinct", [sampler._cdf_distinct, sampler._race_distinct], ids=["cdf", "race"])
def test_draw_without_replacement_draws_in_order_from_the_rest(distinct):
    """Ordered pairs (a, b) come with probability q(a) q(b) / (1 - q(a)); zeros never come. Both
    methods (CPU inverts the CDF, other devices race) run here."""
    q = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    g = torch.Generator().manual_seed(0)
    n, counts = 20000, {}
    for _ in range(n):
        a, b = distinct(q, 2, g).tolist()
        counts[(a, b)] = counts.get((a, b), 0) + 1
    expected = {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in range(5) for b in range(5)
                if a != b and q[a] > 0 and q[b] > 0}
    assert set(counts) <= set(expected)
    tv = 0.5 * sum(abs(counts.get(o, 0) / n - p) for o, p in expected.items())
    assert tv < 3 * math.sqrt(len(expected) / n), tv
    assert distinct(q, 10, g).tolist().__len__() == 4  # only the positive entries
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(distinct(q, 3, g1), distinct(q, 3, g2))


@pytest.mark.parametrize("draws", [sampler._cdf_draws, sampler._race_draws], ids=["cdf", "race"])
def test_both_draw_methods_follow_the_row_in_any_scale(draws):
    """Rows of any positive scale (fp16 wire rows are not renormalised before a draw); zeros never
    come; a row's tokens depend on its generator only."""
    q = torch.tensor([[0.0, 3.0, 0.0, 1.0, 4.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.5]])
    gens = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]
    n = 20000
    got = torch.stack([draws(q, gens) for _ in range(n)])  # [n, 2]
    assert (got[:, 1] == 5).all()
    counts = torch.bincount(got[:, 0], minlength=6).float() / n
    tv = 0.5 * float((counts - q[0] / q[0].sum()).abs().sum())
    assert tv < 3 * math.sqrt(3 / n), tv
    alone = draws(q[:1], [torch.Generator().manual_seed(5)])
    assert alone.tolist() == [int(got[0, 0])]


def test_a_uniform_at_the_top_of_its_range_still_lands_on_the_last_positive_entry(monkeypatch):
    """u * total may round up to the total; the draw stays below it, off the zero tail."""
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.full((1,), 1 - 2.0 ** -53, dtype=torch.float64))
    row = torch.tensor([0.0, 5e-324, 0.0, 0.0], dtype=torch.float64)  # a total u * total rounds onto
    assert sampler._cdf_draws(row[None], [torch.Generator()]).tolist() == [1]
    assert sampler._cdf_draws(torch.tensor([[0.2, 0.3, 0.0]]), [torch.Generator()]).tolist() == [1]


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [0.5, math.nan, 0.5], [math.inf, 1.0, 0.0]])
def test_a_row_without_positive_finite_mass_is_refused_by_name(row):
    with pytest.raises(ValueError, match="mass"):
        sampler.draw(torch.tensor([row]), [torch.Generator()])


def test_cdf_draws_never_land_on_zeros_of_a_wide_sparse_row():
    """A whole vocabulary's fp16 row, 1% of it positive, zeros at both ends: the empty CDF
    intervals of the zeros, the tail past the last positive entry included, are never hit."""
    g = torch.Generator().manual_seed(11)
    mask = torch.rand(49152, generator=g) < 0.01
    row = (torch.rand(49152, generator=g) * mask).half()
    row[0] = row[-200:] = 0
    single = torch.cat([sampler.draw(row[None], [g]) for _ in range(5000)])
    assert (row[single] > 0).all()
    for _ in range(500):
        drawn = draw_without_replacement(row, 4, g)
        assert (row[drawn] > 0).all() and len(set(drawn.tolist())) == 4


def test_wire_proposals_are_what_the_draft_draws_from_and_the_target_verifies_with():
    """fp16 rows: tokens under fp16's range are never drafted; the target renormalises the same
    values (not the draft's fp32 ones), and leaves zero rows (leaves) and bad rows to its checks."""
    q = torch.tensor([[0.6, 1e-9, 0.4 - 1e-9, 0.0], [0.0, 0.0, 0.0, 0.0]])
    wire = wire_proposal(q)
    assert wire.dtype == torch.float16 and wire[0, 1] == 0  # flushed: never drawn
    g = torch.Generator().manual_seed(3)
    drawn = {t for _ in range(200) for t in draw_without_replacement(wire[0], 3, g).tolist()}
    assert drawn == {0, 2}
    got = received_proposal(wire)
    assert got.dtype == torch.float32 and torch.equal(got[1], torch.zeros(4))
    assert torch.allclose(got[0], wire[0].float() / wire[0].float().sum()) and abs(float(got[0].sum()) - 1) < 1e-6
    bad = received_proposal(torch.tensor([[0.5, -0.2, 0.0, 0.0]]))
    assert bad.min() < 0  # a faulty row stays faulty: the target's fits_sampled_tree rejects it


def _sorted_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top-k / top-p / min-p by a full stable sort of one row [V]: what probabilities must give."""
    scaled = (logits - logits.max()) / params.temperature
    probs, order = torch.softmax(scaled, -1).sort(descending=True, stable=True)
    keep = torch.arange(len(probs)) < (params.top_k or len(probs))
    top = probs * keep
    top = top / top.sum()
    keep &= (top.cumsum(0) - top < params.top_p) | (params.top_p >= 1.0)
    keep &= probs >= params.min_p * probs[0]
    keep[0] = True
    kept = probs * keep
    return torch.zeros_like(probs).scatter_(0, order, kept / kept.sum())


def test_top_k_ranks_only_the_best_and_keeps_ties_in_index_order():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g).round(decimals=1)  # many ties
    logits[5] = 0.0  # all tied
    params = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_k=8, top_p=0.7), SamplingParams(temperature=1.2, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=3, min_p=0.5), SamplingParams(temperature=1.0, top_k=2)]
    states = [SamplingState(p, 50) for p in params]
    together = probabilities(process_logits(logits, states), states)
    for i, (p, s) in enumerate(zip(params, states)):
        alone = probabilities(process_logits(logits[i : i + 1], [s]), [s])[0]
        assert torch.equal(alone, together[i])  # whatever else is in the batch
        torch.testing.assert_close(alone, _sorted_reference(logits[i], p), rtol=1e-6, atol=1e-7)
    assert together[5].nonzero().flatten().tolist() == [0, 1]  # ties: the lowest indices
    assert together[1].argmax() == logits[1].argmax()  # top_k=1 is greedy's argmax
