"""The EAGLE-3 draft head: public checkpoints load (pytorch_model.bin and model.safetensors, full
and pruned draft vocabularies), bad ones fail with InvalidArgument naming the problem, and the
paged forward equals a plain reference in fp32, written here from EAGLE-3's published layer
(SafeAILab/EAGLE cnets.py: fc over the aux layers, input_layernorm on the embedding,
hidden_norm on the feature, attention over both, its own norm and lm_head) with HF's rope,
RMSNorm and MLP over whole sequences, no cache. The target's capture of its layers' inputs
equals transformers' hidden_states.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from draft_service.methods import load_eagle
from tandem.attention.torch_backend import TorchAttention
from tandem.errors import InvalidArgument
from tandem.models.config import ModelConfig
from tandem.models.eagle3 import (
    Eagle3Head,
    eagle3_config_for_target,
    is_eagle3_folder,
    load_eagle3_head,
)
from tandem.models.eagle_io import read_eagle_checkpoint, save_eagle_checkpoint
from tandem.kv.batching import append_batch
from tandem.kv.cache import PagedKVCache
from tandem.models.loader import load_model
from tandem.testing.drafts import random_eagle3_checkpoint, random_eagle3_state_dict
from tandem.testing.tiny import build_tiny_model
from tests.unit.test_eagle import HeadRunner, assert_close

AUX = (0, 2, 3)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny4", num_layers=4)


def load(head_dir, target_dir) -> Eagle3Head:
    return load_eagle3_head(head_dir, target_dir, dtype=torch.float32, backend=TorchAttention())


def write_head(out_dir, target_dir, *, vocab_ids=None, edit=None, config_edit=None, fmt="safetensors"):
    """A random EAGLE-3 head; `edit(state)` / `config_edit(config)` alter it first."""
    raw = eagle3_config_for_target(target_dir, draft_vocab_size=None if vocab_ids is None else len(vocab_ids),
                                   aux_layers=AUX)
    state = random_eagle3_state_dict(raw, ModelConfig.from_folder(target_dir), seed=7, vocab_ids=vocab_ids)
    if edit:
        edit(state)
    if config_edit:
        config_edit(raw)
    return save_eagle_checkpoint(out_dir, raw, state, format=fmt)


class Reference(nn.Module):
    """EAGLE-3's forward in plain torch from the public files: causal attention by hand."""

    def __init__(self, head_dir, target_dir):
        super().__init__()
        raw, state = read_eagle_checkpoint(head_dir)
        self.config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("eagle_aux_hidden_state_layer_ids",)})
        c = self.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.w = {k: v.float() for k, v in state.items()}
        self.mlp = LlamaMLP(c)
        self.mlp.load_state_dict({k[len("midlayer.mlp."):]: v for k, v in state.items() if k.startswith("midlayer.mlp.")})
        self.norms = {}
        for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
            norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            norm.weight.data = state[name + ".weight"].float()
            self.norms[name] = norm
        self.rotary = LlamaRotaryEmbedding(c)
        self.embed = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).model.embed_tokens
        self.norm_before_residual = raw.get("norm_before_residual", False)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """tokens [L], features [L, 3D] (the target's aux layers) of one whole sequence -> h^ [L, D]."""
        return self.forward_fused(tokens, features @ self.w["fc.weight"].T)

    @torch.no_grad()
    def forward_fused(self, tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """tokens [L], g [L, D]: each position's fused feature (or a drafted position's h^)."""
        length, w, a = tokens.shape[0], self.w, "midlayer.self_attn."
        normed = self.norms["midlayer.hidden_norm"](g)
        x = torch.cat((self.norms["midlayer.input_layernorm"](self.embed(tokens)), normed), dim=-1)
        q = (x @ w[a + "q_proj.weight"].T).view(1, length, self.heads, self.head_dim).transpose(1, 2)
        k = (x @ w[a + "k_proj.weight"].T).view(1, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = (x @ w[a + "v_proj.weight"].T).view(1, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x[None], torch.arange(length)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        attn = attn.transpose(1, 2).reshape(length, -1) @ w[a + "o_proj.weight"].T
        h = (normed if self.norm_before_residual else g) + attn
        return h + self.mlp(self.norms["midlayer.post_attention_layernorm"](h))

    @torch.no_grad()
    def scores(self, h: torch.Tensor) -> torch.Tensor:
        return self.norms["norm"](h) @ self.w["lm_head.weight"].T


def check_against_reference(head_dir, target_dir) -> None:
    """Packed prefill of 7 + 5 pairs, a decode step on the target's features, then a draft step
    on the head's own output (h^ fed back, as drafting does), against the reference."""
    head, ref = load(head_dir, target_dir), Reference(head_dir, target_dir)
    run = HeadRunner(head)
    gen = torch.Generator().manual_seed(4)
    width = 3 * head.config.hidden_size
    tok = {1: torch.randint(3, 400, (9,), generator=gen), 2: torch.randint(3, 400, (7,), generator=gen)}
    feat = {1: torch.randn(9, width, generator=gen), 2: torch.randn(7, width, generator=gen)}
    got = dict(zip((1, 2), run.step([(1, tok[1][:7], feat[1][:7]), (2, tok[2][:5], feat[2][:5])])))
    for s, out in zip((1, 2), run.step([(1, tok[1][7:8], feat[1][7:8]), (2, tok[2][5:6], feat[2][5:6])])):
        got[s] = torch.cat((got[s], out))
    for s in (1, 2):
        n = len(got[s])
        assert_close(got[s], ref(tok[s][:n], feat[s][:n]))
        assert_close(head.scores(got[s]), ref.scores(got[s]))
    # A draft step: h^ of the last pair is the feature of the next (speculative) position.
    drafted = {s: head.logits(got[s][-1:]).argmax(-1) for s in (1, 2)}
    outs = run.step([(s, drafted[s], got[s][-1:]) for s in (1, 2)])
    for s, out in zip((1, 2), outs):
        n = len(got[s])
        g = torch.cat((feat[s][:n] @ ref.w["fc.weight"].T, got[s][-1:]))
        assert_close(out, ref.forward_fused(torch.cat((tok[s][:n], drafted[s])), g)[-1:])


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_forward_matches_reference(target, tmp_path, fmt):
    head_dir = write_head(tmp_path / "head", target, fmt=fmt)
    assert is_eagle3_folder(head_dir)
    check_against_reference(head_dir, target)


def test_norm_before_residual_heads_match_reference(target, tmp_path):
    check_against_reference(write_head(tmp_path / "nbr", target, config_edit=lambda c: c.update(norm_before_residual=True)),
                            target)


def test_pruned_vocabulary_scores_only_its_tokens(target, tmp_path):
    vocab = ModelConfig.from_folder(target).vocab_size
    ids = torch.arange(1, vocab, 3)
    head = load(write_head(tmp_path / "pruned", target, vocab_ids=ids), target)
    assert torch.equal(head.vocab_ids, ids)
    logits = head.logits(torch.randn(2, head.config.hidden_size))
    assert logits.shape == (2, vocab) and torch.isinf(logits[:, 0]).all() and torch.isfinite(logits[:, ids]).all()


def test_the_eagle_method_loads_either_generation(target, tmp_path):
    """`--draft eagle` takes an EAGLE-3 folder as it is, and it names the target layers it reads."""
    head = load_eagle(write_head(tmp_path / "e3", target, fmt="bin"), target, "float32", "cpu")
    assert isinstance(head, Eagle3Head) and head.feature_layers == AUX and head.feature_width == 3 * 64
    default = random_eagle3_checkpoint(tmp_path / "default", target)
    assert load(default, target).feature_layers == (1, 2)  # EAGLE-3's 2, L/2, L-3 of 4 layers: 2, 2, 1


@pytest.mark.parametrize("edit, config_edit, message", [
    (lambda s: s.pop("midlayer.hidden_norm.weight"), None, "lacks weight midlayer.hidden_norm.weight"),
    (lambda s: s.update({"fc.weight": torch.zeros(64, 128)}), None, r"fc.weight has shape \[64, 128\], config wants \[64, 192\]"),
    (None, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 4]), r"aux layers \[0, 2, 4\] are not distinct"),
    (None, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 0, 3]), r"\[2, 0, 3\] .* in ascending order"),
    (None, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1]), r"aux layers \[1\]: it fuses at least 2"),
    (None, lambda c: c.update(num_hidden_layers=2), "num_hidden_layers is 2; only 1"),
    (None, lambda c: c.update(hidden_size=32, num_attention_heads=2), "hidden_size 32"),
    (lambda s: s.pop("d2t"), None, "lacks d2t"),
    (lambda s: s.update(d2t=torch.zeros(100, dtype=torch.long)), None, r"d2t has shape \[100\]"),
    (lambda s: s.update(d2t=-torch.arange(s["d2t"].shape[0])), None, "one to one"),  # all on token 0
])
def test_bad_checkpoints_name_the_problem(target, tmp_path, edit, config_edit, message):
    ids = torch.arange(0, ModelConfig.from_folder(target).vocab_size, 2)
    with pytest.raises(InvalidArgument, match=message):
        load(write_head(tmp_path / "bad", target, vocab_ids=ids, edit=edit, config_edit=config_edit), target)


def test_target_captures_the_inputs_of_its_layers(target):
    """LlamaModel.forward(capture=...) returns, after the final-norm hidden states, the residual
    stream entering each named layer: transformers' hidden_states[i]."""
    model = load_model(target, dtype=torch.float32, backend=TorchAttention())
    c = model.config
    cache = PagedKVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_pages=8,
                         page_size=4, dtype=model.dtype)
    tokens = list(range(5, 16))
    cache.allocator.add(1)
    batch, _ = append_batch(cache, model.backend, [(1, tokens)], None, torch.device("cpu"))
    wide = model.forward(batch, cache, capture=(3, 0, 2))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    d = model.config.hidden_size
    assert wide.shape == (len(tokens), 4 * d)
    assert_close(wide[:, :d], states[-1][0])
    for j, layer in enumerate((3, 0, 2)):
        assert_close(wide[:, d * (j + 1): d * (j + 2)], states[layer][0])


def test_int8_projections_predict_close_to_fp32(target, tmp_path):
    """head_int8 / lm_head_int8 (tandem up's CPU defaults): fc, the layer and the lm_head hold int8
    weights; the outputs and scores stay within a few percent."""
    from tandem.models.linear import Int8Linear

    head_dir = write_head(tmp_path / "head", target)
    exact = load(head_dir, target)
    int8 = load_eagle3_head(head_dir, target, dtype=torch.float32, backend=TorchAttention(), head_int8=True,
                            lm_head_int8=True)
    layer = int8.weights.layer
    assert all(isinstance(p, Int8Linear) for p in (int8.weights.fc, layer.qkv, layer.o, layer.gate_up, layer.down,
                                                  int8.lm_head))
    gen = torch.Generator().manual_seed(1)
    tokens, features = torch.randint(3, 400, (5,), generator=gen), torch.randn(5, 3 * 64, generator=gen)
    want, got = (HeadRunner(h).step([(1, tokens, features)])[0] for h in (exact, int8))
    assert not torch.equal(want, got) and (got - want).abs().max() < 0.05 * want.abs().max()
    scores = exact.scores(want)
    assert (int8.scores(want) - scores).abs().max() < 0.05 * scores.abs().max()
