"""Suffix drafting: a tree of likely continuations from what followed the sequence's recent
tokens before, in its own prompt and output and in recent outputs of other requests (Snowflake's
suffix decoding, with counts of contexts instead of a suffix tree). Token ids only, no model.
Pure: no gRPC, no tensors.

`ContextCounts` counts, for every context of 1..max_depth tokens in a token stream, the tokens
that followed it. A proposal grows a tree best first: each node's children are the tokens that
followed the longest context ending at it that occurred before, scored by their share of those
occurrences times their parent's score; nodes under `min_score` are not proposed, so the tree
is deep where a long match makes the continuation near certain and shallow where it is not.
"""

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Sequence


class ContextCounts:
    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.followers: dict[tuple[int, ...], Counter] = {}

    def add(self, tokens: Sequence[int], start: int = 0, sign: int = 1) -> None:
        """Counts each token of tokens[start:] after its contexts in `tokens` (sign -1 forgets
        them again)."""
        for i in range(max(start, 1), len(tokens)):
            for m in range(1, min(self.max_depth, i) + 1):
                context = tuple(tokens[i - m : i])
                counts = self.followers.setdefault(context, Counter())
                counts[tokens[i]] += sign
                if counts[tokens[i]] <= 0:
                    del counts[tokens[i]]
                    if not counts:
                        del self.followers[context]

    def longest(self, tokens: Sequence[int]) -> Counter | None:
        """The followers of the longest context ending `tokens` that occurred before."""
        for m in range(min(self.max_depth, len(tokens)), 0, -1):
            found = self.followers.get(tuple(tokens[len(tokens) - m :]))
            if found:
                return found
        return None


class RecentOutputs:
    """The context counts of the last outputs of finished requests, at most `max_tokens` of
    them (the oldest forgotten first): what other requests just wrote often comes again."""

    def __init__(self, max_depth: int, max_tokens: int):
        self.counts = ContextCounts(max_depth)
        self.max_tokens = max_tokens
        self._outputs: deque[tuple[int, ...]] = deque()
        self._size = 0

    def add(self, output: Sequence[int]) -> None:
        output = tuple(output[-self.max_tokens :])
        self.counts.add(output)
        self._outputs.append(output)
        self._size += len(output)
        while self._size > self.max_tokens:
            old = self._outputs.popleft()
            self.counts.add(old, sign=-1)
            self._size -= len(old)


def propose_tree(tokens: Sequence[int], sources: Iterable[ContextCounts], budget: int,
                 min_score: float, max_children: int = 4) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Up to `budget` draft nodes continuing `tokens`, as (tokens, parents): node i + 1 is
    tokens[i], its parent parents[i] (0: the root, the last of `tokens`), parents before
    children. Followers found in the sources are merged (the sequence's own first: its counts
    are added to, not replaced by, the others')."""
    sources = list(sources)
    depth = max(s.max_depth for s in sources) if sources else 0
    nodes: list[int] = []
    parents: list[int] = []
    paths: list[tuple[int, ...]] = [tuple(tokens[len(tokens) - depth :]) if depth else ()]
    frontier: list[tuple[float, int, int, int]] = []  # (-score, order, parent node, token)
    order = 0

    def expand(node: int, score: float) -> None:
        nonlocal order
        merged: Counter = Counter()
        for source in sources:
            found = source.longest(paths[node])
            if found:
                merged.update(found)
        total = sum(merged.values())
        for token, count in merged.most_common(max_children):
            child = score * count / total
            if child >= min_score:
                heapq.heappush(frontier, (-child, order, node, token))
                order += 1

    expand(0, 1.0)
    while frontier and len(nodes) < budget:
        negative, _, parent, token = heapq.heappop(frontier)
        nodes.append(token)
        parents.append(parent)
        paths.append((paths[parent] + (token,))[-depth:])
        expand(len(nodes), -negative)
    return tuple(nodes), tuple(parents)
