"""The CUDA-graph path's static buffers and padded key plans (tandem.models.cuda_graphs), run
eagerly on the CPU (capture=False): every step equals the plain forward and writes the same KV.
Capturing and replaying run where a GPU is (the last test; skipped here)."""

import pytest
import torch

from tandem.attention.torch_backend import TorchAttention
from tandem.kv.batching import append_batch
from tandem.kv.cache import PagedKVCache
from tandem.launcher import service_args
from tandem.models.cuda_graphs import GraphedForward
from tandem.models.loader import load_model
from tandem.testing.tiny import build_tiny_model
from tests.unit.test_tree_attention import tree_input

W = 64  # the tiny model's hidden size: the width of the embeddings each step passes

def new_cache(model):
    mc = model.config
    return PagedKVCache(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                        num_pages=64, page_size=4, dtype=model.dtype, device=model.weights.embed.device)


class Pair:
    """The same steps through the plain forward and the graphed one, on two caches."""

    def __init__(self, model, capture=False, **kw):
        self.model, self.plain, self.graphed = model, new_cache(model), new_cache(model)
        self.device = model.weights.embed.device
        self.forward = GraphedForward(lambda batch, embeds: model.forward(batch, self.graphed, embeds),
                                      capture=capture, **kw)

    def twice(self, items, trees=None):
        """Runs the step's shape twice, on two sequences of the same length: the first runs
        eagerly, the second through the static buffers."""
        self.step(items, trees)
        self.step([(seq_id + 100, tokens) for seq_id, tokens in items],
                  {seq_id + 100: tree for seq_id, tree in (trees or {}).items()})

    def step(self, items, trees=None):
        for cache in (self.plain, self.graphed):
            for seq_id, _ in items:
                if seq_id not in cache.allocator._seqs:
                    cache.allocator.add(seq_id)
        batch, _ = append_batch(self.plain, self.model.backend, items, None, self.device, trees)
        expected = self.model.forward(batch, self.plain)
        batch, _ = append_batch(self.graphed, self.model.backend, items, None, self.device, trees)
        got = self.forward(batch, self.model.embed(batch.input_ids))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(self.graphed.k, self.plain.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(self.graphed.v, self.plain.v, rtol=1e-5, atol=1e-5)


def tiny(tmp_path, device="cpu"):
    return load_model(build_tiny_model(tmp_path / "tiny", seed=3), dtype=torch.float32,
                      backend=TorchAttention(device), device=device)


def steps(pair):
    pair.twice([(1, list(range(5, 18)))])  # a prefill of 13 tokens: above max_tokens, eager
    pair.twice([(1, [30])])  # one query seeing every key: the plan has no mask, the pad adds one
    pair.twice([(1, [31])])
    pair.twice([(2, [7, 8, 9])])
    pair.twice([(1, [32]), (2, [10])])  # two sequences of different lengths
    pair.twice([(1, [11, 21, 22, 31, 41])], {1: tree_input((-1, 0, 0, 1, 3))})  # a tree verify
    pair.twice([(1, [33]), (2, [12, 13])])


def test_decode_and_verify_steps_equal_the_plain_forward(tmp_path):
    pair = Pair(tiny(tmp_path), max_tokens=8)
    steps(pair)
    assert set(pair.forward._graphs) == {(1, 1, 1, 4, W), (3, 1, 3, 1, W), (2, 2, 1, 4, W), (5, 1, 5, 8, W), (3, 2, 2, 8, W)}
    assert not pair.forward._seen  # the prefill, above max_tokens, is never counted


def test_a_shape_seen_once_gets_no_buffers(tmp_path):
    pair = Pair(tiny(tmp_path))
    pair.step([(1, [5, 6, 7])])
    assert not pair.forward._graphs and list(pair.forward._seen) == [(3, 1, 3, 1, W)]


def test_a_shape_seen_again_refills_its_buffers(tmp_path):
    pair = Pair(tiny(tmp_path))
    pair.twice([(1, [5, 6, 7, 8])])
    for token in (40, 41, 42, 43, 44):  # lengths 5..8 hold 2 pages of 4: one shape; 9 holds 3, padded to 4
        pair.twice([(1, [token])])
    assert list(pair.forward._graphs) == [(4, 1, 4, 1, W), (1, 1, 1, 2, W), (1, 1, 1, 4, W)]


def test_least_recently_used_shapes_are_dropped(tmp_path):
    pair = Pair(tiny(tmp_path), max_graphs=2)
    pair.twice([(1, [5, 6])])
    pair.twice([(1, [7, 8, 9])])
    pair.twice([(1, [10])])
    assert list(pair.forward._graphs) == [(3, 1, 3, 2, W), (1, 1, 1, 2, W)]


def test_inputs_of_another_width_get_their_own_graph(tmp_path):
    """An EAGLE-3 head's steps take the target's aux layers (3D wide) or its own outputs (D) at
    the same token shape: each width has its own buffers, and each step equals the plain run."""
    model = tiny(tmp_path)
    fold = lambda x: x if x.shape[-1] == W else x[:, :W] + x[:, W:].sum(-1, keepdim=True)  # noqa: E731
    pair = Pair(model)
    pair.forward = GraphedForward(lambda batch, x: model.forward(batch, pair.graphed, fold(x)), capture=False)
    gen = torch.Generator().manual_seed(0)
    for seq_id, width in ((1, W), (2, W), (3, 3 * W), (4, 3 * W)):
        for cache in (pair.plain, pair.graphed):
            cache.allocator.add(seq_id)
        x = torch.randn(2, width, generator=gen)
        batch, _ = append_batch(pair.plain, model.backend, [(seq_id, [5, 6])], None, pair.device)
        expected = model.forward(batch, pair.plain, fold(x))
        batch, _ = append_batch(pair.graphed, model.backend, [(seq_id, [5, 6])], None, pair.device)
        torch.testing.assert_close(pair.forward(batch, x), expected, rtol=1e-5, atol=1e-5)
    assert list(pair.forward._graphs) == [(2, 1, 2, 1, W), (2, 1, 2, 1, 3 * W)]


def test_enforce_eager_reaches_both_model_services(tmp_path):
    from tandem.cli import build_parser, draft_config, target_config

    args = build_parser().parse_args(["target", "--enforce-eager"])
    assert target_config(args, tmp_path).cuda_graphs is False
    args = build_parser().parse_args(["draft", "--draft-model", str(tmp_path)])
    assert draft_config(args, tmp_path).cuda_graphs is True
    up = build_parser().parse_args(["up", "--enforce-eager", "--draft", "eagle", "--draft-model", str(tmp_path)])
    target, _, draft = service_args(up, tmp_path)
    assert "--enforce-eager" in target and "--enforce-eager" in draft


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_replay_the_plain_forward_on_a_gpu(tmp_path):
    pair = Pair(tiny(tmp_path, "cuda"), capture=True, max_tokens=8)
    steps(pair)
    assert not pair.forward.failed and pair.forward.captured == 5
    assert all(g.graph is not None for g in pair.forward._graphs.values())
