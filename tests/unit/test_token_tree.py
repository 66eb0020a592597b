"""Unit tests of tandem.spec.token_tree: literal trees, Medusa choices, EAGLE-2 dynamic growth."""

import math

import pytest
import torch

from tandem.spec.token_tree import (
    MEDUSA_CHAIN_4,
    SMALL_STATIC_TREE,
    TokenTree,
    chain,
    chain_choices,
    from_medusa_choices,
    grow_dynamic_tree,
    sorted_choices,
)

T, F = True, False

#        0 (10)
#       /      \
#    1 (11)    2 (12)
#    /   \        \
# 3 (13) 4 (14)   5 (15)
SMALL = TokenTree(parents=(-1, 0, 0, 1, 1, 2), tokens=(10, 11, 12, 13, 14, 15))
SMALL_MASK = [
    [T, F, F, F, F, F],
    [T, T, F, F, F, F],
    [T, F, T, F, F, F],
    [T, T, F, T, F, F],
    [T, T, F, F, T, F],
    [T, F, T, F, F, T],
]


# --- TokenTree --------------------------------------------------------------------------------


def test_small_tree_topology():
    assert len(SMALL) == 6 and SMALL.num_drafts == 5 and SMALL.max_depth == 2
    assert SMALL.depths == (0, 1, 1, 2, 2, 2)
    assert SMALL.children == ((1, 2), (3, 4), (5,), (), (), ())
    assert SMALL.leaves == (3, 4, 5)
    assert SMALL.paths() == ((0, 1, 3), (0, 1, 4), (0, 2, 5))
    assert SMALL.path_to(4) == (0, 1, 4) and SMALL.path_to(2) == (0, 2) and SMALL.path_to(0) == (0,)


def test_small_tree_mask_and_positions():
    mask = SMALL.attention_mask()
    assert mask.dtype == torch.bool and mask.tolist() == SMALL_MASK
    assert SMALL.positions(7).tolist() == [7, 8, 8, 9, 9, 9]
    assert SMALL.positions().dtype == torch.long


def test_a_deeper_branch_after_a_shallow_one():
    # Topological but not breadth-first: node 3 hangs under node 2, node 4 under node 1.
    tree = TokenTree(parents=[-1, 0, 0, 2, 1, 3], tokens=[0, 1, 2, 3, 4, 5])
    assert tree.depths == (0, 1, 1, 2, 2, 3)
    assert tree.paths() == ((0, 1, 4), (0, 2, 3, 5))
    assert tree.attention_mask()[5].tolist() == [T, F, T, T, F, T]
    assert tree.tokens == (0, 1, 2, 3, 4, 5) and tree.parents == (-1, 0, 0, 2, 1, 3)  # tuples


def test_chain():
    tree = chain([5, 6, 7, 8])
    assert tree.parents == (-1, 0, 1, 2) and tree.tokens == (5, 6, 7, 8)
    assert tree.depths == (0, 1, 2, 3) and tree.leaves == (3,)
    assert tree.paths() == ((0, 1, 2, 3),)
    assert torch.equal(tree.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_root_only():
    tree = chain([9])
    assert tree.num_drafts == 0 and tree.leaves == (0,) and tree.paths() == ((0,),)
    assert tree.attention_mask().tolist() == [[True]]


def test_trees_compare_by_parents_and_tokens():
    assert chain([1, 2]) == TokenTree(parents=(-1, 0), tokens=(1, 2))
    assert chain([1, 2]) != chain([1, 3])
    with pytest.raises(AttributeError):
        SMALL.tokens = (0,)  # frozen


@pytest.mark.parametrize(
    "parents, tokens, message",
    [
        ((-1, 2, 0), (0, 1, 2), "topological"),  # a parent after its child
        ((-1, 1), (0, 1), "topological"),  # its own parent
        ((0, 0), (0, 1), "root"),  # parents[0] must be -1
        ((-1, 0), (0,), "one parent per token"),
        ((), (), "one parent per token"),
        ((-1, 0, 0), (0, 4, 4), "repeat a token"),  # siblings with one token
        ((-1, 0), (0, -1), ">= 0"),
    ],
)
def test_contract_errors(parents, tokens, message):
    with pytest.raises(AssertionError, match=message):
        TokenTree(parents=parents, tokens=tokens)


def test_path_to_out_of_range():
    with pytest.raises(AssertionError):
        SMALL.path_to(6)


def test_equal_tokens_on_different_branches_are_fine():
    tree = TokenTree(parents=(-1, 0, 0, 1, 2), tokens=(0, 1, 2, 3, 3))
    assert tree.paths() == ((0, 1, 3), (0, 2, 4))


# --- Medusa choices ---------------------------------------------------------------------------


def test_from_medusa_choices_two_depths():
    choices = [(1,), (0, 1), (0,), (1, 0), (0, 0)]  # any order: sorted by depth, then ranks
    topk_tokens = [[7, 3, 9], [4, 8]]  # depth 1: 7, 3, 9; depth 2: 4, 8 (under every parent)
    tree = from_medusa_choices(choices, topk_tokens, root_token=2)
    # nodes: 1 (0,) -> 7, 2 (1,) -> 3, 3 (0, 0) -> 4, 4 (0, 1) -> 8, 5 (1, 0) -> 4
    assert tree.parents == (-1, 0, 0, 1, 1, 2)
    assert tree.tokens == (2, 7, 3, 4, 8, 4)
    assert tree.attention_mask().tolist() == SMALL_MASK  # the same shape as SMALL
    as_tensor = torch.tensor([[7, 3, 9], [4, 8, 5]])  # [D, K]: rank 2 of depth 2 is unused
    assert from_medusa_choices(choices, as_tensor, 2) == tree


def test_sorted_choices_is_medusas_order():
    assert sorted_choices([[1, 0], [2], [0], [0, 0], [1]]) == ((0,), (1,), (2,), (0, 0), (1, 0))


def test_chain_choices_give_the_chain():
    assert chain_choices(3) == ((0,), (0, 0), (0, 0, 0)) and chain_choices(0) == ()
    assert MEDUSA_CHAIN_4 == chain_choices(4)
    topk_tokens = [[5, 1], [6, 1], [7, 1]]
    assert from_medusa_choices(chain_choices(3), topk_tokens, 4) == chain([4, 5, 6, 7])


def test_small_static_tree():
    topk_tokens = torch.arange(12).reshape(4, 3)  # distinct ids per depth
    tree = from_medusa_choices(SMALL_STATIC_TREE, topk_tokens, root_token=99)
    assert tree.num_drafts == len(SMALL_STATIC_TREE) == 10
    assert tree.max_depth == 4 and len(tree.children[0]) == 3
    assert tree.path_to(10) == (0, 1, 4, 7, 10)  # the all-top-1 chain
    assert [tree.tokens[i] for i in tree.path_to(10)] == [99, 0, 3, 6, 9]
    assert tree.leaves == (3, 6, 8, 9, 10)


@pytest.mark.parametrize(
    "choices, message",
    [
        ([(0,), (0, 0), (1, 0)], "parent"),  # (1,) is missing
        ([(0,), (0,)], "repeat"),
        ([(0,), (-1,)], ">= 0"),
        ([(0,), (2,)], "beyond top-k"),
        ([(0,), (0, 0), (0, 0, 0)], "deeper"),
    ],
)
def test_medusa_choices_contract(choices, message):
    with pytest.raises(AssertionError, match=message):
        from_medusa_choices(choices, [[1, 2], [3, 4]], root_token=0)


# --- dynamic trees (EAGLE-2) ------------------------------------------------------------------

# The draft's children of each token: (child token, probability), best first.
TABLE = {
    0: [(1, 0.6), (2, 0.35)],
    1: [(3, 0.5), (4, 0.4)],
    2: [(5, 0.8), (6, 0.1)],
    3: [(7, 0.7), (8, 0.2)],
    5: [(9, 0.6), (10, 0.3)],
}


class TableDraft:
    """A deterministic expand callback over TABLE; numbers candidates as grow_dynamic_tree does."""

    def __init__(self, table, log=True):
        self.table, self.log = table, log
        self.token_of = [0]  # candidate id -> token; the root's token is 0
        self.calls = []

    def __call__(self, frontier):
        self.calls.append(list(frontier))
        out = []
        for node in frontier:
            pairs = self.table[self.token_of[node]]
            self.token_of.extend(t for t, _ in pairs)
            lps = [math.log(p) if self.log else p for _, p in pairs]
            token_ids = torch.tensor([t for t, _ in pairs])
            out.append((token_ids, torch.tensor(lps, dtype=torch.float64)))
        return out


def test_dynamic_tree_literal():
    # Candidates (id: token, score): 1: 1 .6, 2: 2 .35 | 3: 3 .30, 4: 4 .24, 5: 5 .28, 6: 6 .035
    # | (frontier 3, 5) 7: 7 .21, 8: 8 .06, 9: 9 .168, 10: 10 .084. The 7 best: 1 2 3 5 4 7 9.
    draft = TableDraft(TABLE)
    grown = grow_dynamic_tree(0, draft, top_k=2, depth=3, node_budget=7)
    assert draft.calls == [[0], [1, 2], [3, 5]]
    assert grown.tree.parents == (-1, 0, 0, 1, 1, 2, 3, 5)
    assert grown.tree.tokens == (0, 1, 2, 3, 4, 5, 7, 9)
    assert grown.candidate_ids == (0, 1, 2, 3, 4, 5, 7, 9)
    assert grown.dist_rows == (0, 1, 2, 3, -1, 4, -1, -1)  # rows: root, 1, 2, 3, 5
    expected = [1, 0.6, 0.35, 0.3, 0.24, 0.28, 0.21, 0.168]
    assert [math.exp(s) for s in grown.scores] == pytest.approx(expected)


def test_dynamic_tree_node_budget():
    for budget, n in [(0, 1), (1, 2), (5, 6), (10, 11), (100, 11)]:
        grown = grow_dynamic_tree(0, TableDraft(TABLE), top_k=2, depth=3, node_budget=budget)
        assert len(grown.tree) == n  # the root + min(budget, candidates)
    five = grow_dynamic_tree(0, TableDraft(TABLE), top_k=2, depth=3, node_budget=5)
    assert five.tree.parents == (-1, 0, 0, 1, 1, 2) and five.tree.tokens == (0, 1, 2, 3, 4, 5)


def test_dynamic_tree_depth_one_and_top_one():
    grown = grow_dynamic_tree(0, TableDraft(TABLE), top_k=2, depth=1, node_budget=10)
    assert grown.tree == TokenTree(parents=(-1, 0, 0), tokens=(0, 1, 2))
    table = {t: [(t + 1, 0.5)] for t in range(10)}
    grown = grow_dynamic_tree(0, TableDraft(table), top_k=1, depth=4, node_budget=10)
    assert grown.tree == chain([0, 1, 2, 3, 4]) and grown.dist_rows == (0, 1, 2, 3, -1)


def test_dynamic_tree_ties_keep_ancestors():
    # Every token's best child has probability 1 (log 0): a whole path ties with the root's child.
    table = {t: [(2 * t + 1, 0.0), (2 * t + 2, -1.0)] for t in range(64)}
    draft = TableDraft(table, log=False)
    grown = grow_dynamic_tree(0, draft, top_k=2, depth=3, node_budget=3)
    assert draft.calls == [[0], [1, 2], [3, 4]]  # 4 and 5 tie at -1: the lower id
    assert grown.tree == chain([0, 1, 3, 7])  # ids 1, 3, 7 all score 0
    grown = grow_dynamic_tree(0, TableDraft(table, log=False), top_k=2, depth=3, node_budget=4)
    assert grown.tree.parents == (-1, 0, 0, 1, 3) and grown.candidate_ids == (0, 1, 2, 3, 7)


def test_dynamic_tree_random_draft_is_ancestor_closed_and_best_first():
    g = torch.Generator().manual_seed(0)

    def expand(frontier):
        out = []
        for _ in frontier:
            logprobs = torch.log_softmax(torch.randn(8, generator=g), dim=-1)
            top = logprobs.topk(3)
            out.append((top.indices, top.values))
        return out

    for budget in (1, 4, 9, 15):
        grown = grow_dynamic_tree(0, expand, top_k=3, depth=4, node_budget=budget)
        tree = grown.tree
        assert len(tree) == budget + 1
        assert list(grown.candidate_ids) == sorted(grown.candidate_ids)
        for i in range(1, len(tree)):
            assert grown.scores[i] <= grown.scores[tree.parents[i]]
            assert grown.dist_rows[tree.parents[i]] >= 0  # its parent was expanded


@pytest.mark.parametrize(
    "children, message",
    [
        ([(torch.tensor([1, 2, 3]), torch.tensor([-1.0, -2.0, -3.0]))], "top_k"),
        ([(torch.tensor([1, 1]), torch.tensor([-1.0, -2.0]))], "repeated"),
        ([(torch.tensor([1, 2]), torch.tensor([0.5, -2.0]))], "<= 0"),
        ([(torch.tensor([1, 2]), torch.tensor([float("nan"), -2.0]))], "<= 0"),
        ([], "one child list per frontier node"),
    ],
)
def test_dynamic_tree_contract(children, message):
    with pytest.raises(AssertionError, match=message):
        grow_dynamic_tree(0, lambda frontier: children, top_k=2, depth=2, node_budget=4)


def test_dynamic_tree_per_depth_keeps_each_depth_frontier():
    # Frontiers (id: score): depth 1 [1 .6, 2 .35], depth 2 [3 .30, 5 .28], depth 3 [7 .21, 9 .168].
    # Budget 5 keeps 1 2 3 5 7, where the overall rerank keeps 4 (.24) instead of 7 (.21).
    grown = grow_dynamic_tree(0, TableDraft(TABLE), top_k=2, depth=3, node_budget=5, per_depth=True)
    assert grown.candidate_ids == (0, 1, 2, 3, 5, 7)
    assert grown.tree.parents == (-1, 0, 0, 1, 2, 3) and grown.tree.tokens == (0, 1, 2, 3, 5, 7)
    overall = grow_dynamic_tree(0, TableDraft(TABLE), top_k=2, depth=3, node_budget=5)
    assert overall.candidate_ids == (0, 1, 2, 3, 4, 5)
    everything = grow_dynamic_tree(0, TableDraft(TABLE), top_k=2, depth=3, node_budget=100, per_depth=True)
    assert everything.candidate_ids == (0, 1, 2, 3, 5, 7, 9)  # at most top_k nodes per depth


def test_dynamic_tree_per_depth_random_draft_keeps_frontier_prefixes():
    """Each kept depth holds its best top_k; a budget spent mid-depth keeps that depth's best."""
    g = torch.Generator().manual_seed(1)

    def expand(frontier):
        return [(lp.topk(3).indices, lp.topk(3).values)
                for lp in torch.log_softmax(torch.randn(len(frontier), 8, generator=g), dim=-1)]

    for budget in (2, 3, 7, 11, 20):
        grown = grow_dynamic_tree(0, expand, top_k=3, depth=4, node_budget=budget, per_depth=True)
        depths = [len(grown.tree.path_to(i)) - 1 for i in range(1, len(grown.tree))]
        assert len(depths) == min(budget, 12)
        assert [depths.count(d) for d in range(1, 5)] == [min(3, max(budget - 3 * d, 0)) for d in range(4)]
