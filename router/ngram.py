"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of
a sequence's last n tokens, longest n first. Needs token ids only, no model: the router, which
holds every sequence's tokens, drafts with it at no RPC cost. Pure: no gRPC, no tensors.

Each sequence keeps an index from every n-gram (min_n <= n <= max_n) to the end of its latest
occurrence and of the one before it, extended as tokens come: a proposal is a dictionary lookup
per n, whatever the sequence's length.
"""

from collections.abc import Iterable


class NgramIndex:
    """One sequence's tokens (prompt, output, the token about to be decoded) and their n-grams."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> the end of its latest occurrence
        self._before: dict[tuple[int, ...], int] = {}  # -> the end of the occurrence before that

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                gram = tuple(self.tokens[end - n + 1 : end + 1])
                if gram in self._latest:
                    self._before[gram] = self._latest[gram]
                self._latest[gram] = end

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the last n tokens where they occurred before (the
        longest n that did), or () when none did."""
        end = len(self.tokens) - 1
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            gram = tuple(self.tokens[end - n + 1 :])
            previous = self._before.get(gram) if self._latest.get(gram) == end else self._latest.get(gram)
            if previous is not None and previous < end:
                return tuple(self.tokens[previous + 1 : previous + 1 + k])
        return ()
