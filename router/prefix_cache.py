"""The router's radix-tree prefix cache. Pure: no gRPC, no asyncio, no tensors.

Words:
- sequence: a KV sequence of the model services, named by the router's integer seq id. The
  cache holds the tokens whose KV the target holds for it: the router extends it as tokens are
  prefilled or committed, and rolls it back when it pops KV.
- live: the sequence of a running request. recycled: a finished sequence kept, KV and all, for
  a later prompt to take over; at most `max_num_recycling_seqs` (-1: no limit, 0: none) are
  kept, and the least recently recycled is evicted first.
- matched length (of a cached sequence, for a prompt): the longest common prefix of its tokens
  and the prompt but its last token, so that at least one token is left to prefill and sample.
- fork: the new sequence shares the first `prefilled_offset` tokens of a cached one.
- reuse: the new sequence takes over a recycled one, which first pops its last
  `reused_seq_pop_last_tokens` tokens. MLC renames: the new id goes unused and the old one
  lives on. Here the new sequence keeps its own id: it forks the recycled one where the match
  ends and the recycled one is removed, which leaves the same pages in the same hands (no page
  is copied: the last shared page's count drops back to one) and gives each sequence one id
  for its whole life, with its own sampler in the target.

The choice (MLC-LLM cpp/serve/prefix_cache.cc, InsertSequence):
1. Reuse candidates: recycled sequences with the new one's sliding window and attention sink,
   matched length > 0 and, without a sliding window, > `reuse_min_fraction` (0.9) of their
   length (pop at most about a tenth); with one, all of their length (a sliding-window KV
   cannot pop back into its window). Best: longest match, then the shortest sequence.
2. Fork candidates, only for a new sequence without a sliding window: cached sequences, live or
   recycled, without a sliding window (paged KV forks only those), matched length > 0.
   Best: longest match, then the smallest id.
3. Reuse if its match is at least the fork's; else fork; else add an empty sequence.
MLC takes the one longest match in the tree and only the sequences holding it: where that
gives a reuse or a fork, this agrees; where none qualifies, MLC adds an empty sequence and this
takes the best shorter match that qualifies. Extensions apply at once (MLC defers them). LRU
order is recycling order: as in MLC, forking from a recycled sequence does not refresh it.
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.errors import FailedPrecondition, InvalidArgument, NotFound

NO_SLIDING_WINDOW = -1


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How a new sequence starts: from scratch, forked from `forked_seq_id`, or by taking over
    the recycled `reused_seq_id` after popping its last `reused_seq_pop_last_tokens` tokens.
    Its first `prefilled_offset` tokens are then in the KV (0 <= offset <= len(tokens) - 1)."""

    prefilled_offset: int = 0
    forked_seq_id: int | None = None
    reused_seq_id: int | None = None
    reused_seq_pop_last_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SequenceOps:
    """What the router sends to every model service for a new sequence after a match.

    seq_id: the new sequence.
    forked_seq_id, fork_offset: fork seq_id from it, sharing its first fork_offset tokens;
        None: add seq_id as a new empty sequence.
    reused_seq_id: then remove it (a reuse: the new sequence took it over).
    num_prefilled: prompt tokens already in the KV; the target prefills
        tokens[num_prefilled:], a draft lagging by one tokens[num_prefilled + 1:] + [sampled].
    cache_rollback: tokens to roll back in the prefix cache for seq_id, so it mirrors the KV.
    """

    seq_id: int
    forked_seq_id: int | None = None
    fork_offset: int = 0
    reused_seq_id: int | None = None
    num_prefilled: int = 0
    cache_rollback: int = 0


def plan_sequence_ops(seq_id: int, match: PrefixMatch, draft_lags: bool) -> SequenceOps:
    """The ops for `match` of the new `seq_id`; `draft_lags`: an EAGLE draft, whose KV lags
    the target's by one token (draft KV position i holds token i + 1).

    The target and the draft must prefill equally many tokens, so a lagging draft rolls back
    one more token: fork at prefilled_offset - 1, or pop pop_last_tokens + 1 (DESIGN.md 3,
    MLC eagle_new_request_prefill.cc; a reuse forks one token earlier). A fork at 0 tokens is
    an add.
    """
    if match.prefilled_offset == 0:
        return SequenceOps(seq_id)
    back = 1 if draft_lags else 0
    offset = match.prefilled_offset - back
    source = match.forked_seq_id if match.reused_seq_id is None else match.reused_seq_id
    return SequenceOps(seq_id, forked_seq_id=source if offset else None, fork_offset=offset,
                       reused_seq_id=match.reused_seq_id, num_prefilled=offset,
                       cache_rollback=back)


@dataclass(eq=False, slots=True)
class _Node:
    """A radix tree node: the path from the root ends with `edge`, `depth` tokens long."""

    edge: list[int]
    depth: int
    parent: "_Node | None"
    children: dict[int, "_Node"] = field(default_factory=dict)  # by first token of edge
    seqs: set[int] = field(default_factory=set)  # sequences whose tokens hold the whole path
    ends: set[int] = field(default_factory=set)  # sequences whose tokens are the path


def _common_length(edge: list[int], tokens: Sequence[int], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    return next((k for k in range(n) if edge[k] != tokens[start + k]), n)


class _RadixTree:
    """Token sequences by id, sharing common prefixes; each ends at a node."""

    def __init__(self) -> None:
        self.root = _Node([], 0, None)
        self.end: dict[int, _Node] = {}

    def length(self, seq_id: int) -> int:
        return self.end[seq_id].depth

    def tokens(self, seq_id: int) -> list[int]:
        edges, node = [], self.end[seq_id]
        while node is not None:
            edges.append(node.edge)
            node = node.parent
        return [t for edge in reversed(edges) for t in edge]

    def add(self, seq_id: int) -> None:
        self._attach(seq_id, self.root)

    def fork(self, seq_id: int, parent_id: int, offset: int) -> None:
        self._attach(seq_id, self._node_at(self.end[parent_id], offset))

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        node = self.end[seq_id]
        if not tokens:
            return
        if node is not self.root and not node.children and node.ends == {seq_id}:
            node.edge.extend(tokens)  # a leaf of its own: grow it in place
            node.depth += len(tokens)
            return
        node.ends.remove(seq_id)
        end = self._grow(node, tokens, seq_id)
        end.ends.add(seq_id)
        self.end[seq_id] = end
        self._prune(node)

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        old = self.end[seq_id]
        target = self._node_at(old, old.depth - num_tokens)
        node = old
        while node is not target:
            node.seqs.remove(seq_id)
            node = node.parent
        old.ends.remove(seq_id)
        target.ends.add(seq_id)
        self.end[seq_id] = target
        self._prune(old)

    def remove(self, seq_id: int) -> None:
        end = node = self.end.pop(seq_id)
        end.ends.remove(seq_id)
        while node is not None:
            node.seqs.remove(seq_id)
            node = node.parent
        self._prune(end)

    def matched_lengths(self, tokens: Sequence[int]) -> dict[int, int]:
        """Each sequence's longest common prefix with `tokens`; absent: none in common."""
        path, node, i = [], self.root, 0
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            k = _common_length(child.edge, tokens, i)
            path.append((child, i + k))
            if k < len(child.edge):
                break
            node, i = child, i + k
        lengths: dict[int, int] = {}
        for node, depth in reversed(path):
            for seq_id in node.seqs:
                lengths.setdefault(seq_id, depth)
        return lengths

    def _attach(self, seq_id: int, node: _Node) -> None:
        node.ends.add(seq_id)
        self.end[seq_id] = node
        while node is not None:
            node.seqs.add(seq_id)
            node = node.parent

    def _node_at(self, node: _Node, depth: int) -> _Node:
        """The node at `depth` on the path to `node`, splitting an edge if need be."""
        while node.parent is not None and node.parent.depth >= depth:
            node = node.parent
        if node.depth == depth:
            return node
        return self._split(node, depth - (node.depth - len(node.edge)))

    def _split(self, node: _Node, k: int) -> _Node:
        """Cuts `node`'s edge after k tokens; returns the new upper node."""
        upper = _Node(node.edge[:k], node.depth - len(node.edge) + k, node.parent)
        upper.seqs = set(node.seqs)
        node.parent.children[upper.edge[0]] = upper
        node.edge = node.edge[k:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        return upper

    def _grow(self, node: _Node, tokens: Sequence[int], seq_id: int) -> _Node:
        """Walks (and makes) the path of `tokens` below `node` for seq_id; returns its end."""
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(list(tokens[i:]), node.depth + len(tokens) - i, node)
                node.children[tokens[i]] = child
                child.seqs.add(seq_id)
                return child
            k = _common_length(child.edge, tokens, i)
            if k < len(child.edge):
                child = self._split(child, k)
            child.seqs.add(seq_id)
            node, i = child, i + k
        return node

    def _prune(self, node: _Node) -> None:
        """Drops dead leaves above `node`, then merges a pass-through node into its child."""
        while node.parent is not None and not node.ends and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent
        if node.parent is not None and not node.ends and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[node.edge[0]] = child


class PrefixCache:
    """Live and recycled sequences by id, matched against new prompts (see the module doc)."""

    def __init__(self, max_num_recycling_seqs: int, reuse_min_fraction: float = 0.9):
        if max_num_recycling_seqs < -1:
            raise InvalidArgument("max_num_recycling_seqs must be -1 (no limit) or >= 0")
        self.max_num_recycling_seqs = max_num_recycling_seqs
        self.reuse_min_fraction = reuse_min_fraction
        self.reset()

    def reset(self) -> None:
        self._tree = _RadixTree()
        self._window: dict[int, tuple[int, int]] = {}  # (sliding window, attention sink)
        self._recycled: OrderedDict[int, None] = OrderedDict()  # least recently recycled first

    def insert_sequence(self, seq_id: int, tokens: Sequence[int],
                        sliding_window_size: int = NO_SLIDING_WINDOW,
                        attention_sink_size: int = 0,
                        eligible: Callable[[int], bool] | None = None) -> PrefixMatch:
        """Matches a new prompt and enters its sequence (live) as forked, reused or empty.
        `eligible`: only these cached sequences may be matched (say, those a draft mirrors)."""
        if not tokens:
            raise InvalidArgument("tokens must not be empty")
        window = self._new_window(seq_id, sliding_window_size, attention_sink_size)
        lengths = self._tree.matched_lengths(tokens[:-1])
        if eligible is not None:
            lengths = {s: n for s, n in lengths.items() if eligible(s)}
        reusable = [s for s in self._recycled if self._reusable(s, lengths.get(s, 0), window)]
        reused = max(reusable, key=lambda s: (lengths[s], -self._tree.length(s), -s),
                     default=None)
        forkable = [s for s in lengths if self._window[s][0] == NO_SLIDING_WINDOW
                    and window[0] == NO_SLIDING_WINDOW]
        forked = max(forkable, key=lambda s: (lengths[s], -s), default=None)
        if reused is not None and (forked is None or lengths[reused] >= lengths[forked]):
            pop = self._tree.length(reused) - lengths[reused]
            self._window[seq_id] = window
            self._tree.fork(seq_id, reused, lengths[reused])
            self.remove_sequence(reused)
            return PrefixMatch(lengths[reused], reused_seq_id=reused,
                               reused_seq_pop_last_tokens=pop)
        self._window[seq_id] = window
        if forked is None:
            self._tree.add(seq_id)
            return PrefixMatch()
        self._tree.fork(seq_id, forked, lengths[forked])
        return PrefixMatch(lengths[forked], forked_seq_id=forked)

    def touch_best_match(self, tokens: Sequence[int]) -> None:
        """Marks the recycled sequence that best matches a prompt about to be admitted as
        recently used, so that making room for it does not evict its own match first."""
        lengths = self._tree.matched_lengths(tokens[:-1])
        best = max((s for s in lengths if s in self._recycled), key=lambda s: (lengths[s], -s), default=None)
        if best is not None:
            self._recycled.move_to_end(best)

    def _reusable(self, seq_id: int, matched: int, window: tuple[int, int]) -> bool:
        length = self._tree.length(seq_id)
        if matched == 0 or self._window[seq_id] != window:
            return False
        if window[0] == NO_SLIDING_WINDOW:
            return matched > self.reuse_min_fraction * length
        return matched == length

    def _new_window(self, seq_id: int, sliding_window_size: int,
                    attention_sink_size: int) -> tuple[int, int]:
        if self.has_sequence(seq_id):
            raise FailedPrecondition(f"sequence {seq_id} is already cached")
        if sliding_window_size == 0 or sliding_window_size < NO_SLIDING_WINDOW:
            raise InvalidArgument("sliding_window_size must be -1 (none) or positive")
        if attention_sink_size < 0:
            raise InvalidArgument("attention_sink_size must be >= 0")
        return (sliding_window_size, attention_sink_size)

    def extend_sequence(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Appends tokens (prefilled or committed) to a live sequence."""
        self._require(seq_id, live=True)
        self._tree.extend(seq_id, tokens)

    def rollback_sequence(self, seq_id: int, num_tokens: int) -> None:
        """Drops the last `num_tokens` tokens of a live sequence."""
        self._require(seq_id, live=True)
        if not 0 <= num_tokens <= self._tree.length(seq_id):
            raise InvalidArgument(f"cannot roll back {num_tokens} tokens of sequence {seq_id}")
        self._tree.rollback(seq_id, num_tokens)

    def fork_sequence(self, seq_id: int, parent_seq_id: int, forked_offset: int,
                      sliding_window_size: int = NO_SLIDING_WINDOW,
                      attention_sink_size: int = 0) -> None:
        """Enters a new live sequence holding the first `forked_offset` tokens of the parent
        (an n > 1 child). The parent must have no sliding window."""
        window = self._new_window(seq_id, sliding_window_size, attention_sink_size)
        self._require(parent_seq_id)
        if self._window[parent_seq_id][0] != NO_SLIDING_WINDOW:
            raise FailedPrecondition(f"sequence {parent_seq_id} has a sliding window")
        if not 0 <= forked_offset <= self._tree.length(parent_seq_id):
            raise InvalidArgument(f"fork offset {forked_offset} is past sequence {parent_seq_id}")
        self._window[seq_id] = window
        self._tree.fork(seq_id, parent_seq_id, forked_offset)

    def recycle_sequence(self, seq_id: int) -> list[int]:
        """Keeps a finished live sequence as recycled. Returns the ids evicted to make room
        (the sequence itself when recycling is off), which the router removes from the
        model services."""
        self._require(seq_id, live=True)
        if self.max_num_recycling_seqs == 0:
            self.remove_sequence(seq_id)
            return [seq_id]
        evicted = []
        if len(self._recycled) == self.max_num_recycling_seqs:
            evicted = self.try_free_memory()
        self._recycled[seq_id] = None
        return evicted

    def try_free_memory(self) -> list[int]:
        """Evicts the least recently recycled sequence, if any; returns its id ([] if none)."""
        if not self._recycled:
            return []
        seq_id, _ = self._recycled.popitem(last=False)
        self.remove_sequence(seq_id)
        return [seq_id]

    def remove_sequence(self, seq_id: int) -> None:
        """Forgets a live or recycled sequence at once (an aborted request)."""
        self._require(seq_id)
        self._recycled.pop(seq_id, None)
        del self._window[seq_id]
        self._tree.remove(seq_id)

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._tree.end

    def is_recycled(self, seq_id: int) -> bool:
        return seq_id in self._recycled

    def recycled_ids(self) -> list[int]:
        return list(self._recycled)

    def num_recycled(self) -> int:
        return len(self._recycled)

    def num_sequences(self) -> int:
        return len(self._tree.end)

    def sequence_tokens(self, seq_id: int) -> list[int]:
        self._require(seq_id)
        return self._tree.tokens(seq_id)

    def _require(self, seq_id: int, live: bool = False) -> None:
        if not self.has_sequence(seq_id):
            raise NotFound(f"sequence {seq_id} is not cached")
        if live and seq_id in self._recycled:
            raise FailedPrecondition(f"sequence {seq_id} is recycled, not live")
