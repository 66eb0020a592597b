"""What the router lets through of a draft: malformed trees and tokens outside the target's
vocabulary dropped, every draft trimmed to the slots reserved for it (a prefix of a
topologically ordered tree is a tree)."""

from router.drafts import fit_draft

V = 100  # the target's vocabulary


def test_chains_are_trimmed_to_the_cap():
    assert fit_draft((5, 6, 7), (), 2, V) == ((5, 6), ())
    assert fit_draft((5, 6, 7), (), 9, V) == ((5, 6, 7), ())
    assert fit_draft((5, 6, 7), (), 0, V) == ((), ())


def test_trees_keep_their_first_nodes():
    tokens, parents = (5, 6, 7, 8), (0, 0, 1, 2)
    assert fit_draft(tokens, parents, 4, V) == (tokens, parents)
    assert fit_draft(tokens, parents, 2, V) == ((5, 6), (0, 0))


def test_malformed_trees_are_dropped():
    assert fit_draft((5, 6), (0,), 4, V) is None  # a parent missing
    assert fit_draft((5, 6), (0, 2), 4, V) is None  # a parent after its child
    assert fit_draft((5, 5), (0, 0), 4, V) is None  # siblings repeat a token
    assert fit_draft((5, 5), (0, 1), 4, V) == ((5, 5), (0, 1))  # a token may repeat down a path


def test_tokens_outside_the_vocabulary_are_dropped():
    """A faulty draft's token would fail the target's step, every request in it."""
    assert fit_draft((5, V), (), 4, V) is None
    assert fit_draft((5, -1), (0, 0), 4, V) is None
    assert fit_draft((5, V - 1), (), 4, V) == ((5, V - 1), ())
