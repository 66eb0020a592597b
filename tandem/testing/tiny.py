"""Tiny random-weight Hugging Face model folders for tests and reduced benchmarks.

`build_tiny_model` writes a folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load like a real checkpoint: safetensors weights, config,
generation config and a byte-level BPE tokenizer with SmolLM2's special-token ids and ChatML
chat template. Nothing is downloaded; the same arguments give the same files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# Same ids as SmolLM2: the trainer assigns special tokens first, in this order.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = 2
PAD_TOKEN_ID = 0

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_PROMPTS: tuple[str, ...] = (
    "The quick brown fox",
    "Once upon a time, there was",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "In 1969, the first person to walk on the moon",
    "Explain why the sky is blue.",
    "My favourite food is",
)

# Training text for the BPE merges: enough common English that frequent words and
# word pieces become single tokens, so tokenized prompts look like real ones.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. Once upon a time there was a little girl who
lived in a village near the forest. She was very kind and she loved to help her mother and
her father. Every morning she would walk to the market to buy bread, milk and some fruit.
What is the capital of France? The capital of France is Paris. What is the answer to the
question? Please explain the answer in a few words. Write a short story about a dog and a
cat. The weather today is sunny and warm, but tomorrow it will rain. I think that this is
a good idea, and we should do it together. Thank you for your help; you are welcome.
The model reads the prompt and then it writes the next word, one token at a time. We
can make the answer longer or shorter. Why is the sky blue? The light from the sun is
scattered by the air, and blue light is scattered more than red light. Can you tell me
how to cook rice? First wash the rice, then put it in a pot with water and let it boil.
def main(): return print("hello world") if the number is not in the list then add it.
People often say that time is money, but time is also the most important thing we have.
In the beginning of the year the school starts again and the children go back to class.
Here is a simple answer: the sun is a star, the moon goes around the earth, and the earth
goes around the sun. A good question deserves a good answer, so let us think step by step.
She opened the door and saw a small brown dog sitting in the rain. The dog looked at her
and she smiled. "Come in," she said, "you must be cold and hungry." The next day the sun
was shining again, and the children played in the park until the evening came.
Python is a programming language. To write a function in Python, you use the word def,
then the name of the function, and then the arguments in brackets. The function can
return a value. For example, a function that adds two numbers returns their sum.
Here are three things you can do today: read a book, go for a walk, and call a friend.
There are many ways to learn a new language, but the best way is to speak it every day.
The history of the world is long, and people have always told stories about the past.
"""

_ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}

# Std of the random weights: with the usual 0.02 a 64-wide model's logits are nearly flat
# and greedy decoding repeats one token whatever the prompt.
_INIT_STD = 0.2
# 3 special + 256 bytes + 189 merges = 448 tokens, a multiple of 64: the training text has
# enough repeated pairs to reach it, so the model has no ids the tokenizer cannot decode.
_NUM_MERGES = 189


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer: every string encodes (unicode round-trips), common words
    are one token, ids 0/1/2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + 256 + _NUM_MERGES,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        # Decoding must be the exact inverse of encoding (streaming relies on it).
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    out_dir: Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random-weight causal LM plus tokenizer into `out_dir`; returns `out_dir`.

    The model's vocab_size is the tokenizer's length rounded up to a multiple of 64 (as real
    checkpoints pad it); ids past the tokenizer's length are never produced by encoding.
    """
    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {sorted(_ARCHS)}, got {arch!r}")
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    vocab_size = -(-len(tokenizer) // 64) * 64
    config_cls, model_cls = _ARCHS[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        initializer_range=_INIT_STD,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    model.to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every matrix from N(0, _INIT_STD) with our own generator, so the weights do
    not depend on how a transformers version initializes (norms stay 1, biases 0)."""
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        if param.dim() >= 2:
            param.copy_(torch.randn(param.shape, generator=gen) * _INIT_STD)
