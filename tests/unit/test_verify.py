"""Unit tests of tandem.sampling.verify: literal chains, penalties, determinism, distributions."""

import math

import pytest
import torch

from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import probabilities, process_logits, sample
from tandem.sampling.state import SamplingState
from tandem.sampling.verify import VerifiedToken, VerifyResult, fits_chain, verify_chain

V = 5


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """Rows of a few tokens: one thread skips a pool wake-up per op (same results, ~10x faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def state(vocab_size: int = V, **kwargs) -> SamplingState:
    return SamplingState(SamplingParams(**kwargs), vocab_size)


def rows_with_argmax(argmaxes: list[int], vocab_size: int = V) -> torch.Tensor:
    """[len(argmaxes), V] logits: row j is 0 except 3.0 at argmaxes[j]."""
    logits = torch.zeros(len(argmaxes), vocab_size)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 3.0
    return logits


def one_hot(token_ids: list[int], vocab_size: int = V) -> torch.Tensor:
    """[len(token_ids), V] one-hot draft distributions."""
    return torch.nn.functional.one_hot(torch.tensor(token_ids), vocab_size).float()


def ids(result: VerifyResult) -> list[int]:
    return [t.token_id for t in result.tokens]


def target_probs(logits: torch.Tensor, s: SamplingState) -> torch.Tensor:
    """[n, V] target distributions of rows without penalties."""
    return probabilities(process_logits(logits, [s] * logits.shape[0]), [s] * logits.shape[0])


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


# --- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "drafts, num_accepted, emitted",
    [
        ([2, 4, 1], 3, [2, 4, 1, 3]),  # all accepted + bonus 3
        ([0, 4, 1], 0, [2]),  # first rejected: recovered 2
        ([2, 0, 1], 1, [2, 4]),  # middle rejected: recovered 4
        ([2, 4, 0], 2, [2, 4, 1]),  # last rejected: recovered 1
    ],
)
def test_greedy_literal_chains(drafts, num_accepted, emitted):
    s = state(temperature=0.0)
    before = s.generator.get_state()
    result = verify_chain(rows_with_argmax([2, 4, 1, 3]), drafts, None, s)
    assert result.num_accepted == num_accepted
    assert ids(result) == emitted
    assert torch.equal(s.generator.get_state(), before)  # greedy draws nothing


def test_greedy_k0_is_the_argmax():
    result = verify_chain(rows_with_argmax([3]), [], None, state(temperature=0.0))
    assert result.num_accepted == 0 and ids(result) == [3]


def test_greedy_ignores_draft_probs_and_breaks_ties_to_the_lowest_id():
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    result = verify_chain(logits, [2], one_hot([2]), state(temperature=0.0))
    assert result.num_accepted == 0 and ids(result) == [1]
    result = verify_chain(logits, [1], one_hot([1]), state(temperature=0.0))
    assert result.num_accepted == 1 and ids(result) == [1, 0]


def test_logprobs_are_raw_with_top_logprobs():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    s = state(temperature=0.0, top_logprobs=2, repetition_penalty=1.5)
    argmax = logits.argmax(dim=-1).tolist()
    result = verify_chain(logits, argmax[:1] + [(argmax[1] + 1) % V], None, s)
    raw = torch.log_softmax(logits, dim=-1)
    for j, token in enumerate(result.tokens):
        assert isinstance(token, VerifiedToken)
        assert token.logprob == pytest.approx(float(raw[j, token.token_id]))
        values, top_ids = raw[j].topk(2)
        assert [i for i, _ in token.top] == top_ids.tolist()
        assert [v for _, v in token.top] == pytest.approx(values.tolist())
    assert all(t.top == () for t in verify_chain(logits[:1], [], None, state()).tokens)


# --- sampling, literal ------------------------------------------------------------------------


def test_sampling_draft_equal_to_one_hot_target_is_always_accepted():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    argmax = logits.argmax(dim=-1).tolist()  # top_k=1 makes p one-hot at the argmax
    for seed in range(50):
        s = state(top_k=1, seed=seed)
        result = verify_chain(logits, argmax[:2], one_hot(argmax[:2]), s)
        assert result.num_accepted == 2 and ids(result) == argmax  # bonus from p_2


def test_sampling_draft_the_target_never_samples_is_always_rejected():
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0], [0.0] * V])
    uniform = torch.full((1, V), 1.0 / V)
    recovered = set()
    for seed in range(200):
        result = verify_chain(logits, [3], uniform, state(top_k=2, seed=seed))  # p(3) = 0
        assert result.num_accepted == 0 and len(result.tokens) == 1
        recovered.add(result.tokens[0].token_id)
    assert recovered == {0, 1}  # from norm(max(p - q, 0)), never the rejected draft


def test_sampling_k0_is_a_plain_sample():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    for seed in range(20):
        result = verify_chain(logits, [], torch.zeros(0, V), state(temperature=0.8, seed=seed))
        assert ids(result) == sample(logits, [state(temperature=0.8, seed=seed)]).token_ids


def test_sampling_without_draft_probs_records_every_emitted_token():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    accepted = 0
    for seed in range(20):
        s = state(seed=seed, frequency_penalty=0.5)
        result = verify_chain(logits, [int(logits[0].argmax()), 1], None, s)
        accepted += result.num_accepted
        assert len(result.tokens) == result.num_accepted + 1
        assert s.output_counts.tolist() == one_hot(ids(result)).sum(0).tolist()
    assert accepted > 0


def test_contract_asserts():
    with pytest.raises(AssertionError):
        verify_chain(torch.zeros(2, V), [0, 1], None, state(temperature=0.0))  # k + 1 rows
    with pytest.raises(AssertionError):
        verify_chain(torch.zeros(2, V), [0], torch.zeros(2, V), state())  # [k, V] draft probs
    with pytest.raises(AssertionError):
        verify_chain(torch.zeros(2, V), [V], None, state(temperature=0.0))  # token id < V
    with pytest.raises(AssertionError, match="draft probability 0"):
        verify_chain(torch.zeros(2, V), [0], one_hot([1]), state())  # d was not sampled from q


# --- penalties --------------------------------------------------------------------------------

# Row 0 prefers token 1. Row 1 prefers token 1 too, unless the accepted draft 1 is penalised:
# 2.0 / 2 (repetition) or 2.0 - 1 (presence) drops it below token 2's 1.5.
PENALTY_ROWS = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0], [0.0, 2.0, 1.5, 0.0, 0.0], [0.0] * V])


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 2.0}, {"presence_penalty": 1.0}])
def test_greedy_penalises_accepted_drafts(penalty):
    s = state(temperature=0.0, **penalty)
    s.observe_prompt([4])
    result = verify_chain(PENALTY_ROWS, [1, 1], None, s)
    assert result.num_accepted == 1 and ids(result) == [1, 2]  # row 1's argmax flipped to 2
    assert s.output_counts.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]  # the emitted tokens only
    assert s.seen.tolist() == [False, True, True, False, True]


def test_sampling_penalises_accepted_drafts():
    # top_k=1: p_j is one-hot at the penalised argmax, so p_1(1) = 0 once draft 1 is counted.
    for seed in range(20):
        s = state(top_k=1, presence_penalty=1.0, seed=seed)
        result = verify_chain(PENALTY_ROWS, [1, 1], one_hot([1, 1]), s)
        assert result.num_accepted == 1 and ids(result) == [1, 2]
        assert s.output_counts.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]


def test_penalty_bookkeeping_counts_every_emitted_token():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4))
    q = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(5)), dim=-1)
    for seed in range(30):
        s = state(seed=seed, frequency_penalty=0.3, repetition_penalty=1.2)
        s.observe_output(0)
        result = verify_chain(logits, [1, 2, 1], q, s)
        expected = torch.bincount(torch.tensor([0, *ids(result)]), minlength=V).float()
        assert torch.equal(s.output_counts, expected)
        assert len(result.tokens) == result.num_accepted + 1


# --- determinism ------------------------------------------------------------------------------


def test_same_seed_same_result_whatever_runs_in_between():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(6))
    q = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(7)), dim=-1)
    drafts = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(8))[:, 0].tolist()
    alone = [verify_chain(logits, drafts, q, state(seed=s)) for s in range(20)]
    interleaved = []
    for seed in range(20):
        verify_chain(logits, drafts, q, state(seed=seed + 100))  # another sequence
        interleaved.append(verify_chain(logits, drafts, q, state(seed=seed)))
    assert alone == interleaved
    assert len({tuple(ids(r)) for r in alone}) > 1  # the seed matters


# --- distributions ----------------------------------------------------------------------------

# 0.999 quantiles of the chi-square distribution by degrees of freedom (scipy is not installed).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def assert_distributed_as(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """counts: [V] observed; probs: [V] the distribution they must follow (seeded, so exact)."""
    n = float(counts.sum())
    support = probs > 0
    assert counts[~support].sum() == 0  # never a token the target cannot sample
    expected = n * probs[support]
    assert expected.min() >= 5  # the chi-square approximation holds
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[int(support.sum()) - 1]
    assert total_variation(counts, probs) < 3 * math.sqrt(len(probs) / n)


@pytest.mark.parametrize(
    "params", [{"temperature": 0.7}, {"temperature": 1.3}, {"temperature": 1.0, "top_p": 0.8}]
)
def test_first_emitted_token_is_distributed_as_p0(params):
    vocab, n = 6, 5000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(10))
    q = torch.softmax(torch.randn(1, vocab, generator=torch.Generator().manual_seed(11)), dim=-1)
    g = torch.Generator().manual_seed(12)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g).tolist()  # d_1 ~ q
    counts = torch.zeros(vocab)
    for seed, d in enumerate(drafts):
        result = verify_chain(logits, [d], q, state(vocab, seed=seed, **params))
        counts[result.tokens[0].token_id] += 1
    p0 = target_probs(logits[:1], state(vocab, **params))[0]
    assert_distributed_as(counts, p0)
    with pytest.raises(AssertionError):
        assert_distributed_as(counts, q[0])  # the test tells p from q


def test_second_emitted_token_after_an_accepted_draft_is_distributed_as_p1():
    vocab, n = 4, 6000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(20))
    q = torch.softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(21)), dim=-1)
    g = torch.Generator().manual_seed(22)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.tolist()  # d_j ~ q_j
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for seed, chain in enumerate(drafts):
        result = verify_chain(logits, chain, q, state(vocab, seed=seed))
        first[result.tokens[0].token_id] += 1
        if result.num_accepted >= 1:  # tokens[1] follows the accepted draft d_1
            second[result.tokens[1].token_id] += 1
    p = target_probs(logits, state(vocab))
    assert_distributed_as(first, p[0])
    assert second.sum() > n / 3
    assert_distributed_as(second, p[1])
    with pytest.raises(AssertionError):
        assert_distributed_as(second, q[1])


def test_without_draft_probs_the_drafts_are_point_masses_and_tokens_follow_p():
    """No proposal (it timed out, or did not fit): the drafts count as chosen deterministically;
    the first token follows p_0, the second p_1 when the first draft was kept."""
    vocab, n = 6, 4000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(30))
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for seed in range(n):
        result = verify_chain(logits, [int(logits[0].argmax()), 0], None, state(vocab, seed=seed))
        first[result.tokens[0].token_id] += 1
        if result.num_accepted:
            second[result.tokens[1].token_id] += 1
    p = target_probs(logits[:2], state(vocab))
    assert_distributed_as(first, p[0])
    assert_distributed_as(second, p[1])


# --- proposals the target receives ------------------------------------------------------------


def test_a_chain_cut_after_drafting_keeps_its_first_proposal_rows_and_faulty_rows_verify_nothing():
    from target_service.entries import chain_proposal

    q = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(3)), dim=-1)
    drafts = [1, 2]  # the router kept 2 of the 4 drafts (pages short, the context's end)
    assert torch.equal(chain_proposal(q, drafts, 6, 1), q[:2])
    assert chain_proposal(q[:1], drafts, 6, 1) is None  # fewer rows than drafts
    assert chain_proposal(q[:, :5] / q[:, :5].sum(-1, keepdim=True), drafts, 6, 1) is None  # another vocabulary
    for fault in ("nan", "negative", "zero at the draft"):
        bad = q.clone()
        if fault == "nan":
            bad[1, 0] = float("nan")
        elif fault == "negative":
            bad[0, 3], bad[0, 4] = -0.1, bad[0, 4] + 0.1
        else:
            bad[1, 2], bad[1, 0] = 0.0, bad[1, 0] + bad[1, 2]
        assert not fits_chain(bad[:2], drafts) and chain_proposal(bad, drafts, 6, 1) is None, fault
