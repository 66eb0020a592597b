"""The router's tokenizer: a chat template's refusal is the client's error, named."""

import pytest

from router.tokenizer import Tokenizer
from tandem.errors import FailedPrecondition, InvalidArgument
from tandem.testing.tiny import build_tokenizer

# Mistral's and Llama-2's templates raise like this on a system turn or turns out of order.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}assistant:"
)


def test_a_chat_template_refusal_is_invalid_argument(tmp_path):
    hf = build_tokenizer()
    hf.chat_template = STRICT_TEMPLATE
    hf.save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.encode_chat([("user", "hi")]) == tokenizer.encode_prompt("user: hi\nassistant:")
    with pytest.raises(InvalidArgument, match=r"messages: .*roles must alternate"):
        tokenizer.encode_chat([("user", "hi"), ("user", "again")])


def test_a_broken_chat_template_is_the_servers_fault(tmp_path):
    hf = build_tokenizer()
    hf.chat_template = "{% for m in messages %}{{ m['content'] }"  # unclosed expression
    hf.save_pretrained(tmp_path)
    with pytest.raises(FailedPrecondition, match="chat template fails"):
        Tokenizer(tmp_path).encode_chat([("user", "hi")])


# -- the router's tokenizer equals transformers' (it reads the folder without transformers) ----

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "héllo wörld — ünïcödé ✓ 漢字 🙂",
         "<|im_start|>user\nliteral specials<|im_end|>", "don't , stop . here ?", ""]
CHATS = [[("user", "Hi!")], [("system", "Be brief."), ("user", "Why is the sky blue?")],
         [("user", "a"), ("assistant", "b"), ("user", "c 🙂")]]


def _folders(tmp_path):
    build_tokenizer().save_pretrained(tmp_path / "tiny")
    folders = [tmp_path / "tiny"]
    from tandem.models.fetch import model_dir, tandem_home

    default = model_dir(tandem_home(), "float32")
    if (default / "tokenizer.json").exists():  # fetched by scripts/test before the suite
        folders.append(default)
    return folders


def test_the_routers_tokenizer_equals_transformers(tmp_path):
    from transformers import AutoTokenizer

    from router.detokenizer import skipped_ids

    for folder in _folders(tmp_path):
        ours, theirs = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        assert "transformers" not in type(ours.hf).__module__
        for text in TEXTS:
            assert ours.encode_prompt(text) == list(theirs(text)["input_ids"]), (folder, text)
            ids = list(theirs(text)["input_ids"])
            for skip in (True, False):
                assert ours.hf.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        for chat in CHATS:
            messages = [{"role": r, "content": c} for r, c in chat]
            text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert ours.encode_chat(chat) == list(theirs(text, add_special_tokens=False)["input_ids"]), (folder, chat)
        assert skipped_ids(ours.hf) == skipped_ids(theirs)
        assert ours.hf.eos_token_id == theirs.eos_token_id
        assert ours.token_text(5) == theirs.decode([5], skip_special_tokens=False)
