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
    query_valid: torch.Tensor  # [B, max_q] bool
    key_slots: torch.Tensor  # [B, max_k] int64: cache slot of each padded key (pad: 0)
    mask: torch.Tensor | None  # [B, 1, max_q, max_k] bool, None when no mask is needed


class TorchAttention(AttentionBackend):
    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def plan(self, slices: list[SequenceSlice], sliding_window: int | None) -> TorchPlan:
        max_q = max(s.num_new for s in slices)
        max_k = max(s.num_cached + s.num_new for s in slices)
        batch = len(slices)
        query_index = torch.zeros(batch, max_q, dtype=torch.int64)
        key_slots = torch.zeros(batch, max_k, dtype=torch.int64)
        q_lens = torch.tensor([s.num_new for s in slices])
        k_lens = torch.tensor([s.num_cached + s.num_new for s in slices])
        start = 0
        for row, s in enumerate(slices):
            query_index[row, : s.num_new] = torch.arange(start, start + s.num_new)
            key_slots[row, : len(s.key_slots)] = torch.tensor(s.key_slots, dtype=torch.int64)
            start += s.num_new
        q_idx = torch.arange(max_q)
        query_valid = q_idx[None, :] < q_lens[:, None]
        mask = None
        if batch > 1 or max_q > 1 or sliding_window is not None:
            mask = _causal_mask(q_lens, k_lens, max_q, max_k, sliding_window)
        dev = self.device
        return TorchPlan(
            query_index=query_index.to(dev),
            query_valid=query_valid.to(dev),
            key_slots=key_slots.to(dev),
            mask=None if mask is None else mask.to(dev),
        )

    def forward(self, layer, q, k, v, cache: PagedKVCache, slot_mapping, plan: TorchPlan, scale):
        cache.k[layer].index_copy_(0, slot_mapping, k)
        cache.v[layer].index_copy_(0, slot_mapping, v)
        keys = cache.k[layer][plan.key_slots].transpose(1, 2)  # [B, kvh, max_k, d]
        values = cache.v[layer][plan.key_slots].transpose(1, 2)
        queries = q[plan.query_index].transpose(1, 2)  # [B, h, max_q, d]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=plan.mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)[plan.query_valid]  # [T, h, d], packed order


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
