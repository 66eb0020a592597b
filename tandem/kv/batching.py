"""Packs the new tokens of many sequences into one forward batch over a paged KV cache."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tandem.attention.base import AttentionBackend, SequenceSlice
from tandem.kv.cache import PagedKVCache
from tandem.models.llama import ForwardBatch


@dataclass(frozen=True, slots=True)
class TreeInput:
    """An item's new tokens are nodes of a token tree, in topological order.

    depths[i]: new token i sits at position root_position + depths[i]; root_position None means
        the sequence's cached length (the root is the first new token, as in tree verification).
    mask: [n, span] bool, n <= span: new token i sees the sequence's last `span` keys (the
        span - n cached keys just before the new tokens, then the n new ones) where mask[i] is
        true, and every key before them. span = n: the whole tree is new (verification);
        span > n: the new nodes continue tree nodes appended by earlier calls (EAGLE tree
        drafting appends a tree depth by depth)."""

    depths: tuple[int, ...]
    mask: torch.Tensor  # [n, span] bool
    root_position: int | None = None


def append_batch(
    cache: PagedKVCache,
    backend: AttentionBackend,
    items: Sequence[tuple[int, Sequence[int]]],  # (seq_id, new input token ids), in packed order
    sliding_window: int | None,
    device: torch.device,
    trees: Mapping[int, TreeInput] | None = None,  # seq_id -> its tree (tree verify, tree drafting)
) -> tuple[ForwardBatch, dict[int, int]]:
    """Reserves KV slots for every item's tokens (copy-on-write done) and plans attention;
    returns the batch and each sequence's first packed row."""
    allocator = cache.allocator
    trees = trees or {}
    ids, positions, slots, slices, first_rows = [], [], [], [], {}
    for seq_id, tokens in items:
        cached = allocator.length(seq_id)
        tree = trees.get(seq_id)
        if tree is not None:
            _check_tree(tree, len(tokens), cached)
        new_slots, copies = allocator.append(seq_id, len(tokens))
        cache.apply_copies(copies)
        first_rows[seq_id] = len(ids)
        ids.extend(tokens)
        if tree is None:
            positions.extend(range(cached, cached + len(tokens)))
        else:
            root = cached if tree.root_position is None else tree.root_position
            positions.extend(root + d for d in tree.depths)
        slots.extend(new_slots)
        slices.append(SequenceSlice(cached, len(tokens), allocator.slots(seq_id), tree.mask if tree else None))
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        plan=backend.plan(slices, sliding_window, cache.page_size),
    )
    return batch, first_rows


def _check_tree(tree: TreeInput, num_new: int, cached: int) -> None:
    """Checked before any slot is reserved."""
    span = tree.mask.shape[1] if tree.mask.dim() == 2 else -1
    assert len(tree.depths) == num_new and tree.mask.shape[0] == num_new, (len(tree.depths), tree.mask.shape, num_new)
    assert num_new <= span <= cached + num_new, f"tree mask span {span}: not in [{num_new}, {cached + num_new}]"
