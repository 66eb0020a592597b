"""The torch backend's page-at-a-time key gather equals the slot-at-a-time one."""

import torch

from tandem.attention.base import SequenceSlice
from tandem.attention.torch_backend import TorchAttention
from tandem.kv.cache import PagedKVCache


def test_page_gather_equals_slot_gather():
    torch.manual_seed(0)
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_pages=32, page_size=4, dtype=torch.float32)
    a = cache.allocator
    cache.k[0].normal_()
    cache.v[0].normal_()
    lengths = {1: (9, 1), 2: (0, 6), 3: (3, 2)}  # seq: (cached, new)
    for seq, (cached, new) in lengths.items():
        a.add(seq)
        a.append(seq, cached + new)
    a.fork(4, 1, 6)  # a fork mid-page, then its own token
    a.append(4, 1)
    lengths[4] = (6, 1)
    slices = [SequenceSlice(c, n, a.slots(s)) for s, (c, n) in lengths.items()]
    tokens = sum(n for _, n in lengths.values())
    q = torch.randn(tokens, 4, 8)
    k, v = torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)
    slots = torch.tensor([x for s, (c, n) in lengths.items() for x in a.slots(s)[c : c + n]])
    backend = TorchAttention()
    outs = []
    for page_size in (1, 4):
        plan = backend.plan(slices, None, page_size)
        outs.append(backend.forward(0, q, k, v, cache, slots, plan, 8**-0.5))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    single = backend.plan(slices[:1], None, 4)  # one sequence, its last page partly filled
    assert single.mask is not None and single.max_k == 12
