"""The tiny random-weight model folders load like real checkpoints and behave usefully."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.testing.tiny import CHATML_TEMPLATE, TINY_PROMPTS, build_tiny_model

ROUND_TRIP = [
    "héllo 世界 🙂",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "hello , world . (spaces before punctuation stay)",
    "<|im_start|> inside text",
    "Ünïcödé: ñ, ß, Ω, ㄱ, 🇫🇷, 👩‍👩‍👧",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def test_folder_has_checkpoint_files(tiny_dir):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["eos_token_id"] == 2
    assert json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_special_tokens_match_smollm2(tokenizer, model):
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [0, 1, 2]
    assert tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 0
    assert tokenizer.bos_token is None
    assert tokenizer("hello")["input_ids"] == tokenizer.encode("hello", add_special_tokens=False)
    assert model.config.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2


def test_vocab_sizes(tokenizer, model):
    assert 384 <= len(tokenizer) <= 512
    assert model.config.vocab_size % 64 == 0
    assert model.config.vocab_size >= len(tokenizer)
    # The merges are trained: common words are single tokens.
    assert len(tokenizer.encode(" the")) == 1


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens_encode_whole_and_skip(tokenizer):
    ids = tokenizer.encode("a<|im_end|>b")
    assert 2 in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_chat_template(tokenizer):
    assert tokenizer.chat_template == CHATML_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _greedy(model, tokenizer, prompt: str, n: int = 20) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_greedy_output_varies_by_prompt(model, tokenizer):
    outputs = [_greedy(model, tokenizer, p) for p in TINY_PROMPTS]
    assert len(TINY_PROMPTS) == 8
    assert len({tuple(o) for o in outputs}) == len(outputs)
    for out in outputs:
        assert len(out) == 20
        assert len(set(out)) >= 5, out  # not one token repeated
    assert len({o[0] for o in outputs}) >= 4  # first tokens depend on the prompt


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = load_file(build_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_archs_load_and_run(tmp_path, arch):
    folder = build_tiny_model(
        tmp_path / arch,
        arch=arch,
        num_layers=1,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == arch
    assert model.config.num_hidden_layers == 1
    assert model.config.rope_parameters["rope_type"] == "linear"
    assert model.dtype == torch.bfloat16
    assert not model.config.tie_word_embeddings
    # qwen2 loads as Qwen2Tokenizer (transformers forces it), which adds NFC normalization:
    # text already in NFC still round-trips.
    text = "héllo 世界 🙂"
    assert tok.decode(tok.encode(text)) == text
    logits = model(torch.tensor([tok.encode(TINY_PROMPTS[0])])).logits
    assert logits.shape[-1] == model.config.vocab_size
    assert torch.isfinite(logits).all()


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path, arch="gpt2")
