"""EAGLE and Medusa heads with a pruned draft vocabulary (EAGLE-3's d2t map) score only its
tokens: their logits equal the full head's, every other token is at -inf."""

import pytest
import torch
from safetensors.torch import save_file

from tandem.attention.torch_backend import TorchAttention
from tandem.errors import InvalidArgument
from tandem.models.eagle import load_eagle_head
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.models.medusa import load_medusa_heads, random_medusa_checkpoint
from tandem.testing.tiny import build_tiny_model


def test_pruned_head_scores_only_its_vocabulary(tmp_path):
    target = build_tiny_model(tmp_path / "tiny", seed=0)
    head_dir = random_eagle_checkpoint(tmp_path / "head", target, seed=1)
    full = load_eagle_head(head_dir, target, dtype=torch.float32, backend=TorchAttention())
    keep = torch.tensor([2, 5, 6, 40, 100])
    save_file({"d2t": keep - torch.arange(5), "t2d": torch.zeros(full.config.vocab_size, dtype=torch.bool)},
              str(head_dir / "d2t.safetensors"))
    pruned = load_eagle_head(head_dir, target, dtype=torch.float32, backend=TorchAttention())
    features = torch.randn(3, full.config.hidden_size)
    expected, got = full.logits(features), pruned.logits(features)
    torch.testing.assert_close(got[:, keep], expected[:, keep])
    others = torch.ones(full.config.vocab_size, dtype=torch.bool)
    others[keep] = False
    assert torch.isneginf(got[:, others]).all()


def test_a_d2t_map_out_of_the_vocabulary_is_refused(tmp_path):
    target = build_tiny_model(tmp_path / "tiny", seed=0)
    head_dir = random_eagle_checkpoint(tmp_path / "head", target, seed=1)
    save_file({"d2t": torch.tensor([0, 10**6])}, str(head_dir / "d2t.safetensors"))
    with pytest.raises(InvalidArgument, match="d2t"):
        load_eagle_head(head_dir, target, dtype=torch.float32, backend=TorchAttention())


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_pruned_medusa_heads_score_only_their_vocabulary(tmp_path, own_lm_head):
    target = build_tiny_model(tmp_path / "tiny", seed=0)
    head_dir = random_medusa_checkpoint(tmp_path / "medusa", target, num_heads=3, seed=2, own_lm_head=own_lm_head)
    full = load_medusa_heads(head_dir, target, dtype=torch.float32)
    keep = torch.tensor([2, 5, 6, 40, 100])
    save_file({"d2t": keep - torch.arange(5)}, str(head_dir / "d2t.safetensors"))
    pruned = load_medusa_heads(head_dir, target, dtype=torch.float32)
    features = torch.randn(4, full.config.hidden_size)
    for heads in (1, 3):
        expected, got = full.logits(features, heads), pruned.logits(features, heads)
        assert got.shape == expected.shape
        torch.testing.assert_close(got[:, :, keep], expected[:, :, keep])
        others = torch.ones(full.config.vocab_size, dtype=torch.bool)
        others[keep] = False
        assert torch.isneginf(got[:, :, others]).all()


def test_a_medusa_d2t_map_out_of_the_vocabulary_is_refused(tmp_path):
    target = build_tiny_model(tmp_path / "tiny", seed=0)
    head_dir = random_medusa_checkpoint(tmp_path / "medusa", target, num_heads=2, own_lm_head=False)
    save_file({"d2t": torch.tensor([3, 3, -2])}, str(head_dir / "d2t.safetensors"))  # ids 3, 4, 0: fine
    assert load_medusa_heads(head_dir, target, dtype=torch.float32).vocab_ids.tolist() == [3, 4, 0]
    save_file({"d2t": torch.tensor([1, 0])}, str(head_dir / "d2t.safetensors"))  # ids 1, 1: not one to one
    with pytest.raises(InvalidArgument, match="d2t"):
        load_medusa_heads(head_dir, target, dtype=torch.float32)


def test_an_int8_lm_head_scores_the_pruned_vocabulary_close_to_fp32(tmp_path):
    target = build_tiny_model(tmp_path / "tiny", seed=0)
    head_dir = random_eagle_checkpoint(tmp_path / "head", target, seed=1)
    keep = torch.arange(0, 400, 3)
    save_file({"d2t": keep - torch.arange(len(keep))}, str(head_dir / "d2t.safetensors"))
    exact = load_eagle_head(head_dir, target, dtype=torch.float32, backend=TorchAttention())
    int8 = load_eagle_head(head_dir, target, dtype=torch.float32, backend=TorchAttention(), lm_head_int8=True)
    features = torch.randn(6, exact.config.hidden_size)
    expected, got = exact.logits(features), int8.logits(features)
    assert got.dtype == torch.float32 and torch.isneginf(got).sum() == torch.isneginf(expected).sum()
    assert (got[:, keep] - expected[:, keep]).abs().max() < 0.02 * expected[:, keep].abs().max()
    assert not torch.equal(got, expected)


def test_int8_head_projections_predict_features_close_to_fp32(tmp_path):
    """head_int8: fc and the decoder layer with int8 weights (norms and biases as they were)."""
    from tandem.kv.batching import append_batch
    from tandem.kv.cache import PagedKVCache
    from tandem.models.linear import Int8Linear

    target = build_tiny_model(tmp_path / "tiny", seed=0)
    head_dir = random_eagle_checkpoint(tmp_path / "head", target, seed=1)
    heads = [load_eagle_head(head_dir, target, dtype=torch.float32, backend=TorchAttention(), head_int8=int8)
             for int8 in (False, True)]
    layer = heads[1].layers[0]
    assert all(isinstance(p, Int8Linear) for p in (heads[1].fc, layer.qkv, layer.o, layer.gate_up, layer.down))
    assert heads[1].dtype == torch.float32 and heads[1].fc.bias is not None
    d, tokens = heads[0].config.hidden_size, [5, 9, 2, 7]
    features = torch.randn(len(tokens), d, generator=torch.Generator().manual_seed(3))
    out = []
    for head in heads:
        mc = head.model_config
        cache = PagedKVCache(num_layers=1, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, num_pages=4,
                             page_size=4, dtype=torch.float32)
        cache.allocator.add(1)
        batch, _ = append_batch(cache, head.backend, [(1, tokens)], None, torch.device("cpu"))
        out.append(head.forward(torch.tensor(tokens), features, batch, cache))
    assert out[1].dtype == torch.float32 and not torch.equal(out[0], out[1])
    assert (out[1] - out[0]).abs().max() < 0.05 * out[0].abs().max()


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_int8_applies_to_a_shared_medusa_lm_head_only(tmp_path, own_lm_head, caplog):
    target = build_tiny_model(tmp_path / "tiny", seed=0)
    head_dir = random_medusa_checkpoint(tmp_path / "medusa", target, num_heads=3, seed=2, own_lm_head=own_lm_head)
    exact = load_medusa_heads(head_dir, target, dtype=torch.float32)
    int8 = load_medusa_heads(head_dir, target, dtype=torch.float32, lm_head_int8=True)
    features = torch.randn(4, exact.config.hidden_size)
    expected, got = exact.logits(features), int8.logits(features)
    if own_lm_head:  # each head's own lm_head stays as it is, and the log says so
        torch.testing.assert_close(got, expected)
        assert "int8 applies to a shared lm_head" in caplog.text
    else:
        assert 0 < (got - expected).abs().max() < 0.02 * expected.abs().max()


@pytest.mark.parametrize("bias", [False, True], ids=["raw", "logit bias"])
def test_greedy_tree_children_of_a_pruned_head_are_the_whole_rows_top_k(tmp_path, bias):
    """Greedy rows without a logit bias rank the draft vocabulary's scores directly
    (draft_service.eagle_tree); with one they are widened and biased first. Either way the
    children are the top-k of the processed whole row, with its log-softmax scores."""
    from draft_service.eagle_tree import TreeRoot, grow_trees
    from tandem.sampling.params import SamplingParams
    from tandem.sampling.sampler import process_logits
    from tandem.sampling.state import SamplingState

    target = build_tiny_model(tmp_path / "tiny", seed=0)
    head_dir = random_eagle_checkpoint(tmp_path / "head", target, seed=1)
    keep = torch.arange(0, 400, 3)
    save_file({"d2t": keep - torch.arange(len(keep))}, str(head_dir / "d2t.safetensors"))
    head = load_eagle_head(head_dir, target, dtype=torch.float32, backend=TorchAttention())
    feature = torch.randn(head.config.hidden_size, generator=torch.Generator().manual_seed(5))
    favoured = int(keep[-1])
    params = SamplingParams(temperature=0.0, logit_bias=((favoured, 1e3),) if bias else ())
    state = SamplingState(params, head.config.vocab_size)
    no_nodes = lambda items, trees: [torch.empty(0)] * len(items)  # noqa: E731 (depth 1: the root only)
    tree = grow_trees({1: TreeRoot(7, feature, 10, 1)}, head, {1: state}, no_nodes, top_k=3, node_budget=3)[1]
    whole = torch.log_softmax(process_logits(head.logits(feature[None]), [state])[0], dim=-1)
    top = whole.topk(3)
    assert list(tree.grown.tree.tokens[1:]) == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(tree.grown.scores[1:]), top.values, rtol=1e-5, atol=1e-5)
    assert (favoured in tree.grown.tree.tokens[1:2]) == bias
    assert set(tree.grown.tree.tokens[1:]) <= set(keep.tolist())
