"""Packs the new tokens of many sequences into one forward batch over a paged KV cache."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tandem.attention.base import AttentionBackend, SequenceSlice
from tandem.kv.cache import PagedKVCache
from tandem.models.llama import ForwardBatch


@dataclass(frozen=True, slots=True)
class TreeInput:
    """An item's new tokens form a token tree (in topological node order): node i sits at
    position cached + depths[i] and sees the new nodes where mask[i] is true."""

    depths: tuple[int, ...]
    mask: torch.Tensor  # [n, n] bool


def append_batch(
    cache: PagedKVCache,
    backend: AttentionBackend,
    items: Sequence[tuple[int, Sequence[int]]],  # (seq_id, new input token ids), in packed order
    sliding_window: int | None,
    device: torch.device,
    trees: Mapping[int, TreeInput] | None = None,  # seq_id -> its tree, for tree verification
) -> tuple[ForwardBatch, dict[int, int]]:
    """Reserves KV slots for every item's tokens (copy-on-write done) and plans attention;
    returns the batch and each sequence's first packed row."""
    allocator = cache.allocator
    trees = trees or {}
    ids, positions, slots, slices, first_rows = [], [], [], [], {}
    for seq_id, tokens in items:
        cached = allocator.length(seq_id)
        new_slots, copies = allocator.append(seq_id, len(tokens))
        cache.apply_copies(copies)
        first_rows[seq_id] = len(ids)
        ids.extend(tokens)
        tree = trees.get(seq_id)
        depths = tree.depths if tree else range(len(tokens))
        positions.extend(cached + d for d in depths)
        slots.extend(new_slots)
        slices.append(SequenceSlice(cached, len(tokens), allocator.slots(seq_id), tree.mask if tree else None))
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        plan=backend.plan(slices, sliding_window, cache.page_size),
    )
    return batch, first_rows
