"""Packs the new tokens of many sequences into one forward batch over a paged KV cache."""

from collections.abc import Sequence

import torch

from tandem.attention.base import AttentionBackend, SequenceSlice
from tandem.kv.cache import PagedKVCache
from tandem.models.llama import ForwardBatch


def append_batch(
    cache: PagedKVCache,
    backend: AttentionBackend,
    items: Sequence[tuple[int, Sequence[int]]],  # (seq_id, new input token ids), in packed order
    sliding_window: int | None,
    device: torch.device,
) -> tuple[ForwardBatch, dict[int, int]]:
    """Reserves KV slots for every item's tokens (copy-on-write done) and plans attention;
    returns the batch and each sequence's first packed row."""
    allocator = cache.allocator
    ids, positions, slots, slices, first_rows = [], [], [], [], {}
    for seq_id, tokens in items:
        cached = allocator.length(seq_id)
        new_slots, copies = allocator.append(seq_id, len(tokens))
        cache.apply_copies(copies)
        first_rows[seq_id] = len(ids)
        ids.extend(tokens)
        positions.extend(range(cached, cached + len(tokens)))
        slots.extend(new_slots)
        slices.append(SequenceSlice(cached, len(tokens), allocator.slots(seq_id)))
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        plan=backend.plan(slices, sliding_window, cache.page_size),
    )
    return batch, first_rows
