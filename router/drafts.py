"""Checks and trims what the draft service proposes before it reaches the target. Pure.

A draft is a chain (no parents) or a token tree: `parents[i]` is the parent node of draft i
(node i + 1; node 0 is the root, the last sampled token), parents before children, sibling
tokens distinct. A malformed one is dropped (the sequence then decodes plainly): a faulty draft
service must never fail a request. A well-formed one keeps its first `cap` nodes, which is
still a tree (nodes are in topological order): a verify never takes more KV slots than the
scheduler reserved, nor runs past the context.
"""

from collections.abc import Sequence


def fit_draft(
    tokens: Sequence[int], parents: Sequence[int], cap: int, vocab_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Returns (tokens, parents) trimmed to `cap` nodes, or None when the draft is malformed
    (a token outside the target's vocabulary would fail the target's whole step).
    Trimming keeps a prefix of the nodes: the node numbers the draft's streamed distributions
    index stay valid, and each node keeps the first of its sampled children (lossless)."""
    if parents and not _valid_tree(tokens, parents):
        return None
    if any(not 0 <= t < vocab_size for t in tokens):
        return None
    cap = max(cap, 0)
    return tuple(tokens[:cap]), tuple(parents[:cap])


def _valid_tree(tokens: Sequence[int], parents: Sequence[int]) -> bool:
    """Only siblings must differ: a token may reappear elsewhere in the tree."""
    if len(parents) != len(tokens):
        return False
    if any(not 0 <= p <= i for i, p in enumerate(parents)):
        return False
    siblings = {(p, t) for p, t in zip(parents, tokens)}
    return len(siblings) == len(tokens)
