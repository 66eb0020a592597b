"""Unit tests of tandem.sampling.tree_verify: literal trees, chain equality, distributions."""

import math

import pytest
import torch

from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import draw_without_replacement as sampler_draw_without_replacement
from tandem.sampling.sampler import probabilities, process_logits, sample
from tandem.sampling.state import SamplingState
from tandem.sampling.tree_verify import TreeVerifyResult, verify_tree
from tandem.sampling.verify import verify_chain
from tests.unit.test_verify import one_intra_op_thread  # noqa: F401 (an autouse fixture)
from tandem.spec.token_tree import TokenTree, chain, grow_dynamic_tree

V = 8


def state(vocab_size: int = V, **kwargs) -> SamplingState:
    return SamplingState(SamplingParams(**kwargs), vocab_size)


def rows_with_argmax(argmaxes: list[int], vocab_size: int = V) -> torch.Tensor:
    """[len(argmaxes), V] logits: row i is 0 except 3.0 at argmaxes[i]."""
    logits = torch.zeros(len(argmaxes), vocab_size)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 3.0
    return logits


def ids(result: TreeVerifyResult) -> list[int]:
    return [t.token_id for t in result.tokens]


#        0 (0)
#       /     \
#    1 (1)    2 (2)
#    /   \       \
# 3 (3)  4 (4)   5 (5)
#   |
# 6 (6)
TREE = TokenTree(parents=(-1, 0, 0, 1, 1, 2, 3), tokens=(0, 1, 2, 3, 4, 5, 6))


# --- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argmaxes, accepted_nodes, emitted",
    [
        ([1, 3, 0, 6, 0, 0, 7], (1, 3, 6), [1, 3, 6, 7]),  # the deep branch, bonus 7 at leaf 6
        ([5, 3, 5, 6, 0, 0, 7], (), [5]),  # no depth-1 child matches: recovered 5
        ([2, 3, 5, 6, 0, 0, 7], (2, 5), [2, 5, 0]),  # the second sibling, bonus 0 at leaf 5
        ([1, 4, 5, 6, 2, 0, 7], (1, 4), [1, 4, 2]),  # the second sibling at depth 2, bonus 2
        ([1, 5, 5, 6, 0, 0, 7], (1,), [1, 5]),  # rejected at depth 2: recovered 5
        ([1, 3, 5, 2, 0, 0, 7], (1, 3), [1, 3, 2]),  # rejected under node 3: recovered 2
    ],
)
def test_greedy_literal_trees(argmaxes, accepted_nodes, emitted):
    s = state(temperature=0.0)
    before = s.generator.get_state()
    result = verify_tree(rows_with_argmax(argmaxes), TREE, None, s)
    assert result.accepted_nodes == accepted_nodes
    assert result.num_accepted == len(accepted_nodes) and ids(result) == emitted
    assert torch.equal(s.generator.get_state(), before)  # greedy draws nothing


def test_greedy_root_only_is_the_argmax():
    result = verify_tree(rows_with_argmax([3]), chain([0]), None, state(temperature=0.0))
    assert result.num_accepted == 0 and ids(result) == [3] and result.accepted_nodes == ()


def test_logprobs_are_raw_rows_of_the_accepted_path():
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(0))
    logits[0, 2], logits[2, 5] = 9.0, 9.0  # accept node 2, then node 5 (a leaf)
    result = verify_tree(logits, TREE, None, state(temperature=0.0, top_logprobs=2))
    assert result.accepted_nodes == (2, 5)
    raw = torch.log_softmax(logits, dim=-1)
    for row, token in zip([0, 2, 5], result.tokens, strict=True):
        assert token.logprob == pytest.approx(float(raw[row, token.token_id]))
        assert [i for i, _ in token.top] == raw[row].topk(2).indices.tolist()


# Root 4 has children 1 (node 1) and 2 (node 2); node 1 has children 1 (node 3), 2 (node 4).
PENALTY_TREE = TokenTree(parents=(-1, 0, 0, 1, 1), tokens=(4, 1, 2, 1, 2))
PENALTY_ROWS = torch.zeros(5, V)
PENALTY_ROWS[0, 1], PENALTY_ROWS[0, 2] = 3.0, 1.0  # row 0: 1
PENALTY_ROWS[1, 1], PENALTY_ROWS[1, 2] = 2.0, 1.5  # row 1: 1, or 2 once the accepted 1 is penalised


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"top_k": 1}])
def test_penalties_count_the_accepted_path_only(params):
    # top_k=1: p is one-hot at the penalised argmax, so sampling behaves as greedy here.
    for seed in range(10):
        s = state(presence_penalty=1.0, seed=seed, **params)
        result = verify_tree(PENALTY_ROWS, PENALTY_TREE, None, s)
        assert result.accepted_nodes == (1, 4) and ids(result) == [1, 2, 0]  # row 4: 0 after it
        assert s.output_counts.tolist() == [1.0, 1.0, 1.0, 0, 0, 0, 0, 0]  # emitted tokens only


# --- sampling, literal ------------------------------------------------------------------------


@pytest.mark.parametrize("sampled", [True, False])
def test_sampling_a_sibling_the_target_cannot_sample_passes_to_the_next(sampled):
    logits = torch.zeros(3, V)
    logits[0, 3] = 5.0  # top_k=1: p_0 is one-hot at 3
    tree = TokenTree(parents=(-1, 0, 0), tokens=(0, 1, 3))
    q = torch.full((3, V), 1.0 / V) if sampled else None  # uniform, or point masses
    for seed in range(30):
        result = verify_tree(logits, tree, q, state(top_k=1, seed=seed))
        assert result.accepted_nodes == (2,) and ids(result)[0] == 3


def test_sampling_root_only_is_a_plain_sample():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    for seed in range(20):
        result = verify_tree(logits, chain([0]), None, state(temperature=0.8, seed=seed))
        assert ids(result) == sample(logits, [state(temperature=0.8, seed=seed)]).token_ids


def test_contract_asserts():
    with pytest.raises(AssertionError):
        verify_tree(torch.zeros(6, V), TREE, None, state(temperature=0.0))  # N rows
    with pytest.raises(AssertionError):
        verify_tree(torch.zeros(2, V), chain([0, V]), None, state(temperature=0.0))  # id < V
    with pytest.raises(AssertionError, match="N, V"):
        verify_tree(torch.zeros(7, V), TREE, torch.zeros(6, V), state())
    with pytest.raises(AssertionError, match=r"lacks the nodes with children \[2, 3\]"):
        verify_tree(torch.zeros(7, V), TREE, {0: torch.ones(V), 1: torch.ones(V)}, state())
    q = torch.zeros(2, V)
    q[0, 2] = 1.0
    with pytest.raises(AssertionError, match="draft probability 0"):
        verify_tree(torch.zeros(2, V), chain([0, 1]), q, state())  # 1 was not drawn from q


# --- a chain tree is verify_chain -------------------------------------------------------------

CHAIN_PARAMS = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.3, "top_logprobs": 3},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.8, "frequency_penalty": 0.4},
    {"temperature": 1.2, "top_k": 3, "presence_penalty": 0.5, "top_logprobs": 2},
]


@pytest.mark.parametrize("params", CHAIN_PARAMS)
def test_chain_tree_equals_verify_chain(params):
    k = 3
    for trial in range(40):
        g = torch.Generator().manual_seed(trial)
        logits = torch.randn(k + 1, V, generator=g) * 2
        q = torch.softmax(torch.randn(k + 1, V, generator=g), dim=-1)  # row k: unused
        drafts = torch.multinomial(q[:k], 1, generator=g)[:, 0].tolist()
        if trial % 2:  # half the drafts are the target's argmaxes: long acceptances
            drafts = logits[:k].argmax(dim=-1).tolist()
            q[torch.arange(k), torch.tensor(drafts)] += 1.0
            q = q / q.sum(dim=-1, keepdim=True)
        by_chain, by_tree = state(seed=trial, **params), state(seed=trial, **params)
        by_chain.observe_prompt([0, 1])
        by_tree.observe_prompt([0, 1])
        expected = verify_chain(logits, drafts, q[:k], by_chain)
        result = verify_tree(logits, chain([5, *drafts]), q, by_tree)
        assert result.as_verify_result() == expected
        assert result.accepted_nodes == tuple(range(1, expected.num_accepted + 1))
        assert torch.equal(by_tree.generator.get_state(), by_chain.generator.get_state())
        if by_chain.output_counts is not None:
            assert torch.equal(by_tree.output_counts, by_chain.output_counts)
            assert torch.equal(by_tree.seen, by_chain.seen)


# --- determinism ------------------------------------------------------------------------------


def test_same_seed_same_result_whatever_runs_in_between():
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(6))
    q = torch.softmax(torch.randn(7, V, generator=torch.Generator().manual_seed(7)), dim=-1)
    alone = [verify_tree(logits, TREE, q, state(seed=s)) for s in range(30)]
    interleaved = []
    for seed in range(30):
        verify_tree(logits, TREE, q, state(seed=seed + 100))  # another sequence
        interleaved.append(verify_tree(logits, TREE, q, state(seed=seed)))
    assert alone == interleaved
    assert len({tuple(ids(r)) for r in alone}) > 1  # the seed matters


# --- distributions ----------------------------------------------------------------------------


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of counts [C] against probs [C] (asserts it is applicable)."""
    support = probs > 0
    assert counts[~support].sum() == 0  # never an outcome the target cannot produce
    expected = counts.sum() * probs[support]
    assert expected.min() >= 5
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, chi2.double() / 2))


def assert_distributed_as(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """counts: [C] observed; probs: [C] the distribution they must follow (seeded, so exact)."""
    assert chi2_p_value(counts, probs) > 1e-3
    tv = 0.5 * float((counts / counts.sum() - probs).abs().sum())
    assert tv < 3 * math.sqrt(len(probs) / float(counts.sum()))


def draw_without_replacement(q: torch.Tensor, m: int, g: torch.Generator) -> torch.Tensor:
    """q: [..., V]; m tokens per row drawn one after another without replacement, [..., m].

    The exponential race: token x arrives at E_x / q(x), E ~ Exp(1); the first arrival is ~ q and,
    memoryless, each next arrival is ~ q restricted to the tokens not yet arrived.
    """
    e = torch.empty(q.shape, dtype=torch.float64).exponential_(generator=g)
    return (e / q.double()).argsort(dim=-1)[..., :m]


class TwoLevel:
    """A vocabulary of 6, a target and a draft over two levels of context, and a tree of
    `width[0]` depth-1 siblings, each with `width[1]` depth-2 siblings.

    Target: p0 = P(x1), p1[a] = P(x2 | x1 = a), p2[a, b] = P(x3 | a, b). Draft: q0, q1[a].
    """

    vocab = 6

    def __init__(self, seed: int, width: tuple[int, int]) -> None:
        g = torch.Generator().manual_seed(seed)
        v = self.vocab
        self.l0, self.l1, self.l2 = (torch.randn(*s, generator=g) for s in [(v,), (v, v), (v,) * 3])
        self.q0 = torch.softmax(self.l0 + torch.randn(v, generator=g), dim=-1)
        self.q1 = torch.softmax(self.l1 + torch.randn(v, v, generator=g), dim=-1)
        self.width = width
        s = state(v)
        self.p0 = probabilities(process_logits(self.l0[None], [s]), [s])[0]
        self.p1 = probabilities(process_logits(self.l1, [s] * v), [s] * v)
        self.joint = (self.p0[:, None] * self.p1).flatten()  # [v * v] P(x1, x2)

    def tree(self, first: list[int], second: list[list[int]]) -> tuple[TokenTree, torch.Tensor]:
        """The tree of depth-1 tokens `first` and their children `second`; its logits [N, V]."""
        parents, tokens, rows = [-1], [0], [self.l0]
        for a in first:
            parents.append(0)
            tokens.append(a)
            rows.append(self.l1[a])
        for i, (a, kids) in enumerate(zip(first, second, strict=True)):
            for b in kids:
                parents.append(1 + i)
                tokens.append(b)
                rows.append(self.l2[a, b])
        return TokenTree(parents=tuple(parents), tokens=tuple(tokens)), torch.stack(rows)

    def draft_probs(self, tree: TokenTree) -> dict[int, torch.Tensor]:
        """node -> [V]: q0 for the root's children, q1[a] for the children of a depth-1 node a."""
        return {i: self.q0 if i == 0 else self.q1[tree.tokens[i]] for i in range(1 + self.width[0])}


def run_tree_sampling(setup: TwoLevel, n: int, sampled: bool) -> tuple[torch.Tensor, ...]:
    """n verify steps, each on a fresh draft tree; returns (first counts [V], joint counts [V * V],
    accepted counts [n]). A step that emits one token gets its second from a plain decode step,
    as the next step would."""
    v, (w1, w2) = setup.vocab, setup.width
    g = torch.Generator().manual_seed(1234)
    first = draw_without_replacement(setup.q0.expand(n, v), w1, g)  # [n, w1]
    second = draw_without_replacement(setup.q1[first], w2, g)  # [n, w1, w2]
    top = setup.q0.topk(w1).indices  # [w1] the draft's best depth-1 tokens
    fixed = setup.tree(top.tolist(), setup.q1[top].topk(w2).indices.tolist())
    first_counts, joint_counts, accepted = torch.zeros(v), torch.zeros(v * v), torch.zeros(n)
    for seed in range(n):
        if sampled:
            tree, logits = setup.tree(first[seed].tolist(), second[seed].tolist())
            result = verify_tree(logits, tree, setup.draft_probs(tree), state(v, seed=seed))
        else:  # deterministic top-k children: the same tree every step
            result = verify_tree(fixed[1], fixed[0], None, state(v, seed=seed))
        x = ids(result)
        if len(x) == 1:
            x.append(sample(setup.l1[x[0]][None], [state(v, seed=n + seed)]).token_ids[0])
        first_counts[x[0]] += 1
        joint_counts[x[0] * v + x[1]] += 1
        accepted[seed] = result.num_accepted
    return first_counts, joint_counts, accepted


@pytest.mark.parametrize("sampled", [True, False], ids=["without_replacement", "deterministic"])
@pytest.mark.parametrize("width", [(3, 2), (2, 3)])
def test_tree_sampling_is_distributed_as_the_target(sampled, width):
    setup = TwoLevel(seed=40, width=width)
    first, joint, accepted = run_tree_sampling(setup, n=4000, sampled=sampled)
    assert_distributed_as(first, setup.p0)
    assert_distributed_as(joint, setup.joint)
    # Measured: 1.7-1.8 drafts accepted per step when sampled, 0.9 for top-k children.
    assert 0.6 < float(accepted.mean()) < 1.95  # drafts are often accepted, not always
    assert float((accepted == 2).float().mean()) > 0.2  # the second level is reached
    with pytest.raises(AssertionError):
        assert_distributed_as(first, setup.q0)  # the test tells p from q


def grow_sampled(setup: TwoLevel, g: torch.Generator, *, own_scores: bool) -> tuple:
    """An EAGLE tree grown by tandem.spec.token_tree over TwoLevel's draft: depth 2, top-2, 3
    nodes, children drawn without replacement. own_scores: score each child by its own draft
    probability and keep the best nodes overall (EAGLE-2's rule, made for top-k children); else
    score the j-th draw by the j-th largest probability and keep per depth (the draft service's
    rule for sampled requests). Returns (tree, logits [N, V], draft_probs node -> [V])."""
    token_of = [0]

    def expand(frontier):
        out = []
        for c in frontier:
            q = setup.q0 if c == 0 else setup.q1[token_of[c]]
            kids = sampler_draw_without_replacement(q, 2, g)
            token_of.extend(kids.tolist())
            out.append((kids, q[kids].log() if own_scores else q.sort(descending=True).values[: len(kids)].log()))
        return out

    tree = grow_dynamic_tree(0, expand, top_k=2, depth=2, node_budget=3, per_depth=not own_scores).tree
    rows = [setup.l0 if i == 0 else setup.l1[tree.tokens[i]] if tree.parents[i] == 0
            else setup.l2[tree.tokens[tree.parents[i]], tree.tokens[i]] for i in range(len(tree))]
    probs = {i: setup.q0 if i == 0 else setup.q1[tree.tokens[i]] for i, kids in enumerate(tree.children) if kids}
    return tree, torch.stack(rows), probs


def test_grown_sampled_trees_stay_lossless_only_when_kept_regardless_of_their_own_draws():
    """The budget keeps 3 of the 6 candidates, so which nodes are kept depends on the draws.
    Kept per depth by rank, the first two emitted tokens follow the target; kept by their own
    probabilities, a kept child may be a later draw than verification assumes: biased."""
    setup, n = TwoLevel(seed=40, width=(2, 2)), 3000
    for own_scores in (False, True):
        g, joint = torch.Generator().manual_seed(99), torch.zeros(setup.vocab ** 2)
        for seed in range(n):
            tree, logits, probs = grow_sampled(setup, g, own_scores=own_scores)
            x = ids(verify_tree(logits, tree, probs, state(setup.vocab, seed=seed)))
            if len(x) == 1:
                x.append(sample(setup.l1[x[0]][None], [state(setup.vocab, seed=n + seed)]).token_ids[0])
            joint[x[0] * setup.vocab + x[1]] += 1
        if own_scores:
            with pytest.raises(AssertionError):
                assert_distributed_as(joint, setup.joint)
        else:
            assert_distributed_as(joint, setup.joint)
