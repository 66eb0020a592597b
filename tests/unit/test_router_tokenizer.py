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
