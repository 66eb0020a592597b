"""A target step's entries: their checks, where their logits rows start, a tree entry's mask,
and which proposal rows verify a chain. Pure of the engine's state."""

import logging
from collections.abc import Sequence

import torch

from tandem.errors import InvalidArgument, ResourceExhausted
from tandem.kv.batching import TreeInput
from tandem.ops import EntryKind, StepEntry
from tandem.sampling.verify import fits_chain
from tandem.spec.token_tree import TokenTree

log = logging.getLogger(__name__)


def check_entries(entries: Sequence[StepEntry], allocator, vocab: int, max_context: int) -> None:
    """A step's entries are well formed and fit: each sequence once, tokens in the vocabulary,
    drafts only on sampling decodes (trees well formed), the context and the free pages."""
    seen: set[int] = set()
    pages = 0
    for e in entries:
        if e.seq_id in seen:
            raise InvalidArgument(f"sequence {e.seq_id} appears twice in one step")
        seen.add(e.seq_id)
        if not e.token_ids:
            raise InvalidArgument(f"entry of sequence {e.seq_id} has no tokens")
        if e.num_draft_tokens and (e.kind is not EntryKind.DECODE or not e.sample or e.num_draft_tokens >= len(e.token_ids)):
            raise InvalidArgument(
                f"entry of sequence {e.seq_id}: {e.num_draft_tokens} draft tokens need a sampling DECODE"
                f" entry with more tokens than drafts ({len(e.token_ids)})"
            )
        check_tree(e)
        bad = [t for t in e.token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        length = allocator.length(e.seq_id) + len(e.token_ids)
        if length > max_context:
            raise InvalidArgument(
                f"sequence {e.seq_id} would hold {length} tokens, beyond the context of {max_context}"
            )
        pages += allocator.pages_needed(e.seq_id, len(e.token_ids))
    if pages > allocator.num_free_pages:
        raise ResourceExhausted(f"KV cache full: step needs {pages} pages, {allocator.num_free_pages} free")


def chain_proposal(q: torch.Tensor | None, drafts, vocab_size: int, seq_id: int) -> torch.Tensor | None:
    """A chain's proposal rows as verify_chain takes them: the first k (the router may cut a chain
    after it was drafted; row j belongs to draft j + 1 whatever follows), or None when they
    cannot verify it (a faulty or stale row): the drafts are then verified as point masses."""
    if q is None or q.shape[0] < len(drafts):
        return None
    q = q[: len(drafts)]
    if q.shape[1] != vocab_size or not fits_chain(q, drafts):
        log.warning("draft probabilities of sequence %d do not fit its chain: verified as point masses", seq_id)
        return None
    return q


def verifies_with_q(params) -> bool:
    """Sampled, not keyed: speculative sampling needs the draft's proposal distribution."""
    return not (params.greedy or params.keyed)


def check_tree(e: StepEntry) -> None:
    if not e.tree_parents:
        return
    k = e.num_draft_tokens
    bad = len(e.tree_parents) != k or len(e.token_ids) != k + 1
    bad = bad or any(not 0 <= p <= i for i, p in enumerate(e.tree_parents))
    if bad:
        raise InvalidArgument(
            f"entry of sequence {e.seq_id}: a tree entry is its root and {k} draft tokens, each with"
            f" a parent node before it (node 0 is the root), got {len(e.token_ids)} tokens and"
            f" tree_parents {list(e.tree_parents)}"
        )
    nodes = e.token_ids[len(e.token_ids) - k - 1 :]
    siblings = {(p, nodes[i + 1]) for i, p in enumerate(e.tree_parents)}
    if len(siblings) != k:
        raise InvalidArgument(f"entry of sequence {e.seq_id}: sibling draft tokens repeat a token")


def tree_input(e: StepEntry) -> TreeInput | None:
    """A tree entry's positions and mask (DECODE entries: every token is a tree node)."""
    if not e.tree_parents:
        return None
    tree = TokenTree((-1, *e.tree_parents), e.token_ids)
    return TreeInput(tree.depths, tree.attention_mask())


def rows_of(scored: Sequence[StepEntry]) -> dict[int, int]:
    """Where each scored entry's logits rows start: entries take num_draft_tokens + 1 rows each."""
    starts, offset = {}, 0
    for e in scored:
        starts[e.seq_id] = offset
        offset += e.num_draft_tokens + 1
    return starts
