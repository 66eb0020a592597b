"""Paged KV cache tensors: one flat slot array per layer, addressed through a PageAllocator."""

from collections.abc import Sequence

import torch

from tandem.kv.pages import PageAllocator, PageCopy


class PagedKVCache:
    """Keys and values of every layer: k[layer] is [num_pages * page_size, num_kv_heads, head_dim].

    The allocator decides which slots a sequence owns; this class only stores and copies."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.allocator = PageAllocator(num_pages, page_size)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_size = page_size

    def apply_copies(self, copies: Sequence[PageCopy]) -> None:
        for copy in copies:
            src = copy.src * self.page_size
            dst = copy.dst * self.page_size
            for layer_k, layer_v in zip(self.k, self.v):
                layer_k[dst : dst + copy.num_slots] = layer_k[src : src + copy.num_slots]
                layer_v[dst : dst + copy.num_slots] = layer_v[src : src + copy.num_slots]

    def keep_path(self, seq_id: int, start: int, kept: Sequence[int]) -> None:
        """After tree verification: the sequence's tokens from `start` on were tree nodes in
        node order; keep the nodes `kept` (increasing node indices: a root-to-node path), moved
        to positions start, start + 1, ..., and drop the rest."""
        assert list(kept) == sorted(set(kept)), f"kept nodes must increase: {kept}"
        slots = self.allocator.slots(seq_id)
        num_nodes = len(slots) - start
        assert all(0 <= n < num_nodes for n in kept), (kept, num_nodes)
        moves = [(slots[start + n], slots[start + i]) for i, n in enumerate(kept) if n != i]
        if moves:  # dst <= src, and indexing reads every source before it writes
            src = torch.tensor([m[0] for m in moves], device=self.k[0].device)
            dst = torch.tensor([m[1] for m in moves], device=self.k[0].device)
            for layer_k, layer_v in zip(self.k, self.v):
                layer_k[dst] = layer_k[src]
                layer_v[dst] = layer_v[src]
        self.allocator.pop(seq_id, num_nodes - len(kept))
