"""Attention in plain torch: gathers each sequence's keys from the paged cache into a padded
[B, max_k] batch and runs one scaled_dot_product_attention call per layer."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.attention.base import AttentionBackend, SequenceSlice
from tandem.kv.cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class TorchPlan:
    query_index: torch.Tensor  # [B, max_q] int64: packed token of each padded query (pad: 0)
    # [T] int64 each: the padded (row, query) of each packed token; indices, not a bool mask,
    # whose indexing would wait on the device in every layer (a nonzero per call).
    query_rows: torch.Tensor
    query_cols: torch.Tensor
    key_index: torch.Tensor  # [B * n] int64: cache pages (page_size set) or slots of the padded keys
    max_k: int
    page_size: int  # 1 when key_index holds slots
    mask: torch.Tensor | None  # [B, 1, max_q, max_k] bool, None when no mask is needed


class TorchAttention(AttentionBackend):
    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def plan(self, slices: list[SequenceSlice], sliding_window: int | None, page_size: int = 1) -> TorchPlan:
        """With page_size > 1, keys are gathered a whole page at a time (index_select of
        contiguous blocks: ~8x faster than gathering slot by slot here); the tail of a
        sequence's last page is masked out."""
        max_q = max(s.num_new for s in slices)
        k_lens = torch.tensor([s.num_cached + s.num_new for s in slices])
        max_units = max(-(-int(k) // page_size) for k in k_lens)
        batch = len(slices)
        query_index = torch.zeros(batch, max_q, dtype=torch.int64)
        key_index = torch.zeros(batch, max_units, dtype=torch.int64)
        q_lens = torch.tensor([s.num_new for s in slices])
        start = 0
        for row, s in enumerate(slices):
            query_index[row, : s.num_new] = torch.arange(start, start + s.num_new)
            units = s.key_slots[::page_size]  # a page's slots are contiguous: its first names it
            key_index[row, : len(units)] = torch.tensor(units, dtype=torch.int64) // page_size
            start += s.num_new
        max_k = max_units * page_size
        query_valid = torch.arange(max_q)[None, :] < q_lens[:, None]
        mask = None
        trees = any(s.tree_mask is not None for s in slices)
        if trees or batch > 1 or max_q > 1 or sliding_window is not None or max_k != int(k_lens[0]):
            mask = _causal_mask(q_lens, k_lens, max_q, max_k, sliding_window)
            _apply_trees(mask, slices, sliding_window)
        dev = self.device
        query_rows, query_cols = query_valid.nonzero(as_tuple=True)  # row-major: packed order
        return TorchPlan(
            query_index=query_index.to(dev),
            query_rows=query_rows.to(dev),
            query_cols=query_cols.to(dev),
            key_index=key_index.flatten().to(dev),
            max_k=max_k,
            page_size=page_size,
            mask=None if mask is None else mask.to(dev),
        )

    @staticmethod
    def pad_keys(plan: TorchPlan, units: int) -> TorchPlan:
        """The same attention with each row's keys padded to `units` pages (or slots), the pad
        masked out: one shape for many steps (a CUDA graph's). The pad gathers page 0."""
        batch, max_q = plan.query_index.shape
        have = plan.key_index.numel() // batch
        assert units >= have, (units, have)
        key_index = F.pad(plan.key_index.view(batch, have), (0, units - have)).flatten()
        mask = plan.mask
        if mask is None:  # one query that sees every key
            mask = torch.ones(batch, 1, max_q, plan.max_k, dtype=torch.bool, device=key_index.device)
        mask = F.pad(mask, (0, (units - have) * plan.page_size), value=False)
        return TorchPlan(plan.query_index, plan.query_rows, plan.query_cols, key_index,
                         units * plan.page_size, plan.page_size, mask)

    def forward(self, layer, q, k, v, cache: PagedKVCache, slot_mapping, plan: TorchPlan, scale):
        cache.k[layer].index_copy_(0, slot_mapping, k)
        cache.v[layer].index_copy_(0, slot_mapping, v)
        keys = _gather(cache.k[layer], plan).transpose(1, 2)  # [B, kvh, max_k, d]
        values = _gather(cache.v[layer], plan).transpose(1, 2)
        queries = q[plan.query_index].transpose(1, 2)  # [B, h, max_q, d]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=plan.mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)[plan.query_rows, plan.query_cols]  # [T, h, d], packed order


def _gather(layer_cache: torch.Tensor, plan: TorchPlan) -> torch.Tensor:
    """[slots, kvh, d] -> [B, max_k, kvh, d], a page (or a slot) per index."""
    _, kvh, d = layer_cache.shape
    units = layer_cache.view(-1, plan.page_size, kvh, d).index_select(0, plan.key_index)
    return units.view(plan.query_index.shape[0], plan.max_k, kvh, d)


def _apply_trees(mask: torch.Tensor, slices: list[SequenceSlice], sliding_window: int | None) -> None:
    """Replaces the causal block of a tree's span (its last keys) by its tree mask; mask: [B, 1,
    max_q, max_k], changed in place. A node sits at the span's start + its depth (its ancestors
    in the span, itself included, minus one), not at its packed index: a sliding window over
    the keys before the span is measured from there. (Windows are far longer than trees: the
    span's own keys, ancestors only, are all within it.)"""
    for row, s in enumerate(slices):
        if s.tree_mask is None:
            continue
        end = s.num_cached + s.num_new
        start = end - s.tree_mask.shape[1]
        mask[row, 0, : s.num_new, start:end] = s.tree_mask
        if sliding_window is not None:
            positions = start + s.tree_mask.sum(dim=1) - 1  # [num_new]
            keys = torch.arange(start)
            mask[row, 0, : s.num_new, :start] = (keys[None, :] > positions[:, None] - sliding_window)


def _causal_mask(q_lens, k_lens, max_q, max_k, sliding_window):
    """Query i of a row sits at position k_len - q_len + i and sees keys at positions <= its own
    (and, with a sliding window, > its own - window). Padded queries see key 0 only, so that
    no row of the softmax is empty (their outputs are dropped)."""
    q_pos = (k_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]  # [B, max_q]
    k_pos = torch.arange(max_k)[None, None, :]  # [1, 1, max_k]
    mask = (k_pos <= q_pos[:, :, None]) & (k_pos < k_lens[:, None, None])
    if sliding_window is not None:
        mask &= k_pos > q_pos[:, :, None] - sliding_window
    padded = torch.arange(max_q)[None, :] >= q_lens[:, None]
    mask[padded] = k_pos[0].eq(0).expand(int(padded.sum()), max_k)
    return mask[:, None]
