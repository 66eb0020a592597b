"""The attention interface: a backend plans a batch once per step, then runs every layer.

A batch packs the new tokens of many sequences into one [T] axis: a prefill chunk contributes
its chunk length, a decode step one token (a verify step 1 + k tokens). Each sequence attends to
its cached tokens plus its own new tokens, causally. Backends (torch here, flashinfer on a GPU)
differ only in how they lay the batch out.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tandem.kv.cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """One sequence of a batch: `num_new` tokens appended after `num_cached` cached ones.

    key_slots: flat KV slots of all num_cached + num_new tokens, in order.
    tree_mask: None for causal new tokens; for a token tree a bool [num_new, span] tensor,
        num_new <= span <= num_cached + num_new, over the sequence's last `span` keys: new token
        i sees key num_cached + num_new - span + j iff tree_mask[i, j] (itself and its
        ancestors), and every key before the span. span = num_new for tree verification; a
        longer span reaches tree nodes cached by earlier calls (EAGLE tree drafting)."""

    num_cached: int
    num_new: int
    key_slots: list[int]
    tree_mask: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Plans a batch (metadata shared by all layers) and computes attention for one layer."""

    @abstractmethod
    def plan(self, slices: list[SequenceSlice], sliding_window: int | None, page_size: int = 1) -> object:
        """Returns backend metadata for the batch; slices are in packed-token order; page_size
        is the cache's (a page's slots are contiguous)."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim], rotary already applied
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [T] int64: where each new token's k, v are written
        plan: object,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Writes k, v into the cache, then attends each query to its sequence's keys."""
