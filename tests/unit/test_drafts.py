"""What the router lets through of a draft: malformed trees dropped, every draft trimmed to the
slots reserved for it (a prefix of a topologically ordered tree is a tree)."""

from router.drafts import fit_draft


def test_chains_are_trimmed_to_the_cap():
    assert fit_draft((5, 6, 7), (), 2) == ((5, 6), ())
    assert fit_draft((5, 6, 7), (), 9) == ((5, 6, 7), ())
    assert fit_draft((5, 6, 7), (), 0) == ((), ())


def test_trees_keep_their_first_nodes():
    tokens, parents = (5, 6, 7, 8), (0, 0, 1, 2)
    assert fit_draft(tokens, parents, 4) == (tokens, parents)
    assert fit_draft(tokens, parents, 2) == ((5, 6), (0, 0))


def test_malformed_trees_are_dropped():
    assert fit_draft((5, 6), (0,), 4) is None  # a parent missing
    assert fit_draft((5, 6), (0, 2), 4) is None  # a parent after its child
    assert fit_draft((5, 5), (0, 0), 4) is None  # siblings repeat a token
    assert fit_draft((5, 5), (0, 1), 4) == ((5, 5), (0, 1))  # a token may repeat down a path
