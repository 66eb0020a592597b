"""What the trainer's evaluations count: speculative sampling's acceptance as the overlap of two
distributions, tree acceptance, a static tree fit from rank statistics, the greedy walk, and
answers that loop."""

import pytest
import torch

from tandem.loops import loop_start, loops, repeated_ngram_share
from tandem.train.losses import sampled_acceptance
from tandem.train.acceptance import (anchor_rows, best_static_tree, chain_metrics, draft_ranks, merge_parts,
                                     static_tree_lengths, static_tree_metrics, walk_histogram)


def test_sampled_acceptance_is_the_overlap_of_the_two_distributions():
    gen = torch.Generator().manual_seed(2)
    hidden, teacher = torch.randn(1500, 8, generator=gen), torch.randn(1500, 8, generator=gen)
    lm_head = torch.randn(30, 8, generator=gen)
    columns = torch.tensor([1, 4, 5, 9, 20, 29])  # a pruned draft vocabulary
    got = sampled_acceptance(hidden, lm_head[columns], teacher, lm_head, columns)
    q = torch.softmax(hidden @ lm_head[columns].T, -1)
    p = torch.softmax(teacher @ lm_head.T, -1)
    assert torch.allclose(got, torch.minimum(p[:, columns], q).sum(-1), atol=1e-6)
    assert (got <= p[:, columns].sum(-1) + 1e-6).all()  # mass outside the draft vocabulary is never accepted
    same = sampled_acceptance(teacher, lm_head, teacher, lm_head, None)
    assert torch.allclose(same, torch.ones(1500), atol=1e-5)  # the target's own distribution: always accepted


def test_repeated_ngram_share_tells_a_loop_from_prose():
    assert repeated_ngram_share(list(range(40))) == 0
    assert repeated_ngram_share([7, 8] * 3, n=2) == pytest.approx(3 / 5)  # (7,8) (8,7) new; the other 3 repeat
    loop = list(range(10)) + [20, 21, 22] * 30  # a short answer that falls into a loop
    assert repeated_ngram_share(loop) > 0.8 and repeated_ngram_share([1, 2, 3]) == 0  # shorter than an 8-gram


def test_loop_start_is_where_a_text_first_repeats_itself():
    text = list(range(10)) + [20, 21, 22] * 30
    assert loop_start(text) == 13 and loops(text)  # the 8-gram at 13 is the one at 10 again
    assert loop_start(list(range(40))) == 40 and not loops(list(range(40)))


def test_tree_acceptance_counts_target_tokens_within_the_drafts_top_k():
    top = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    first = draft_ranks(top, torch.tensor([5, 6, 7, 8]), torch.ones(4, dtype=torch.bool))
    second = draft_ranks(top, torch.tensor([6, 5, 5, 5]), torch.tensor([True, False, True, True]))
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [1, 3, 0, 0]  # 3: absent or not an answer token
    got = chain_metrics([first, second], torch.zeros(4, dtype=torch.long))
    assert got["mean_accepted_length"] == (2 + 1 + 1 + 1) / 4 and got["accepted_rate_by_depth"] == [0.25, 0.0]
    assert got["tree_accepted_length"] == {"top2": (3 + 2 + 1 + 1) / 4, "top3": (3 + 2 + 3 + 1) / 4}
    assert got["tree_nodes"] == {"top2": 2 + 4, "top3": 3 + 9}
    # one sequence: the first step accepts 2 and skips anchor 1; the walk verifies from 0, 2 and 3
    assert got["walk_histograms"]["chain"] == [0, 2, 1, 0] and got["walk_accepted_length"] == (2 + 1 + 1) / 3
    assert got["walk_tree_accepted_length"] == {"top2": (3 + 1) / 2, "top3": (3 + 1) / 2}  # from 0 and 3
    assert got["walk_rate_by_depth"] == [round(1 / 3, 4), 0.0]
    halves = merge_parts([chain_metrics([first[:1], second[:1]], torch.zeros(1, dtype=torch.long)),
                     chain_metrics([first[1:], second[1:]], torch.ones(3, dtype=torch.long))])
    assert halves["tree_accepted_length"] == pytest.approx(got["tree_accepted_length"]) and halves["anchors"] == 4
    # two sequences walk apart: the second starts at its own first anchor (1), not where the first's step lands
    assert halves["walk_histograms"]["top3"] == [0, 1, 1, 1] and halves["walk_steps"] == 4


def test_a_static_tree_from_rank_statistics_keeps_the_paths_most_anchors_follow():
    # heads x anchors: ranks of the target's token (3: absent)
    ranks = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 0],
                          [0, 0, 1, 0, 3, 0, 0, 3]])
    assert best_static_tree(ranks, 3, 3) == ((0,), (1,), (0, 0))  # counts 4, 2, then (0,0) 2 before (2,) 1
    tree = best_static_tree(ranks, 5, 3)  # best first: then the count-1 paths, shallower first
    assert tree == ((0,), (1,), (0, 0), (2,), (0, 1))
    assert all(best_static_tree(ranks, n, 3) == tree[:n] for n in range(1, 6))  # every prefix: that size's best
    assert static_tree_lengths(ranks, ((0,), (0, 0)), 3).tolist() == [3, 3, 2, 1, 1, 1, 1, 2]
    # fit on sequence 0 (anchors 0-3), measured on sequence 1 (anchors 4-7)
    got = static_tree_metrics(ranks, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), 3, sizes=(2,))["2"]
    assert got["choices"] == [[0], [0, 0]] and got["mean_accepted_length"] == (1 + 1 + 1 + 2) / 4
    assert got["walk_accepted_length"] == (1 + 1 + 1 + 2) / 4  # every step here moves one anchor but the last
    default = static_tree_metrics(ranks, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), 3, sizes=())["default"]
    assert default["mean_accepted_length"] == (2 + 2 + 1 + 2) / 4  # (1, _), (2, 0): (2,) only, (3, 0): none, (0, _)


def test_the_walk_never_crosses_into_the_next_sequence():
    lengths = torch.tensor([3, 1, 1, 2, 2, 1, 3])  # sequences 0 (anchors 0-2), 1 (3-4), 2 (5-6)
    rows = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    # 0: step of 3 overshoots its 3 anchors; 1: 2 then past the end; 2: 1 then 3
    assert walk_histogram(lengths, rows, 3) == [0, 1, 1, 2]
    assert anchor_rows(torch.tensor([[False, True, True], [True, False, False]])).tolist() == [0, 0, 1]
