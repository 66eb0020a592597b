"""Tree attention over the paged cache: each node of a token tree sees the cached prefix and
its own ancestors, at position cached + depth, so its output equals running its root-to-node
path as a plain causal sequence; keep_path moves an accepted path's KV into place."""

import torch

from tandem.attention.torch_backend import TorchAttention
from tandem.kv.batching import TreeInput, append_batch
from tandem.kv.cache import PagedKVCache
from tandem.models.loader import load_model
from tandem.testing.tiny import build_tiny_model

# Root 0 (the last accepted token) with children 1 and 2; 3 is a child of 1; 4 of 3.
PARENTS = (-1, 0, 0, 1, 3)
TOKENS = (11, 21, 22, 31, 41)
PREFIX = (5, 6, 7, 8, 9, 10, 12)


def tree_input(parents) -> TreeInput:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depths = []
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
        depths.append(0 if p < 0 else depths[p] + 1)
    return TreeInput(tuple(depths), mask)


def path(i):
    nodes = []
    while i >= 0:
        nodes.append(i)
        i = PARENTS[i]
    return nodes[::-1]


def run(model, cache, seq_id, tokens, trees=None):
    batch, rows = append_batch(cache, model.backend, [(seq_id, tokens)], None, torch.device("cpu"), trees)
    return model.forward(batch, cache)


def new_cache(model):
    mc = model.config
    return PagedKVCache(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                        num_pages=64, page_size=4, dtype=model.dtype)


def test_every_tree_node_equals_its_path_run_causally(tmp_path):
    model = load_model(build_tiny_model(tmp_path / "tiny", seed=1), dtype=torch.float32, backend=TorchAttention())
    cache = new_cache(model)
    cache.allocator.add(1)
    run(model, cache, 1, PREFIX)
    tree_out = run(model, cache, 1, TOKENS, {1: tree_input(PARENTS)})
    for node in range(len(PARENTS)):
        ref = new_cache(model)
        ref.allocator.add(2)
        out = run(model, ref, 2, PREFIX + tuple(TOKENS[n] for n in path(node)))
        torch.testing.assert_close(tree_out[node], out[-1], rtol=1e-5, atol=1e-5)


def test_keep_path_compacts_the_accepted_nodes(tmp_path):
    model = load_model(build_tiny_model(tmp_path / "tiny", seed=1), dtype=torch.float32, backend=TorchAttention())
    cache = new_cache(model)
    cache.allocator.add(1)
    run(model, cache, 1, PREFIX)
    run(model, cache, 1, TOKENS, {1: tree_input(PARENTS)})
    cache.keep_path(1, len(PREFIX), [0, 1, 3])  # root, 1, 3 accepted; 2 and 4 dropped
    assert cache.allocator.length(1) == len(PREFIX) + 3
    # The next token after the kept path attends to exactly prefix + path: equal to a plain run.
    after = run(model, cache, 1, (50,))
    ref = new_cache(model)
    ref.allocator.add(2)
    expected = run(model, ref, 2, PREFIX + (11, 21, 31, 50))
    torch.testing.assert_close(after[-1], expected[-1], rtol=1e-5, atol=1e-5)
    free = cache.allocator.num_free_pages
    cache.allocator.remove(1)
    assert cache.allocator.num_free_pages == 64 and free < 64


def test_a_sliding_window_is_measured_from_a_node_s_depth_position():
    from tandem.attention.base import SequenceSlice

    # Root at position 10, three children at 11: with a window of 4 a child sees prefix keys
    # 8..10, whatever its packed index (12 or 13) would say.
    mask = tree_input((-1, 0, 0, 0)).mask
    plan = TorchAttention().plan([SequenceSlice(10, 4, list(range(14)), mask)], sliding_window=4)
    for node, position in enumerate((10, 11, 11, 11)):
        seen = plan.mask[0, 0, node].nonzero().flatten().tolist()
        ancestors = [10 + j for j in range(4) if mask[node, j]]
        assert seen == [k for k in range(10) if position - 4 < k] + ancestors, node
