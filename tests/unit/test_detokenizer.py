"""IncrementalDetokenizer: streamed deltas concatenate to the full decode, never a partial char."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from router.detokenizer import IncrementalDetokenizer
from tandem.testing.tiny import build_tokenizer

TOKENIZER = build_tokenizer()
VOCAB = len(TOKENIZER)
# Byte tokens that are only part of a UTF-8 character (they decode alone to "\ufffd").
PARTIAL_BYTE_IDS = [i for i in range(VOCAB) if "\ufffd" in TOKENIZER.decode([i])]
SPECIAL_IDS = [0, 1, 2]


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def stream(prompt: list[int], chunks: list[list[int]], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(TOKENIZER, prompt, skip_special_tokens=skip)
    return [detok.push(chunk) for chunk in chunks] + [detok.flush()]


def one_by_one(ids: list[int]) -> list[list[int]]:
    return [[i] for i in ids]


def test_emoji_split_over_byte_tokens_is_held_until_complete():
    ids = encode("🙂")
    assert len(ids) == 4  # four byte tokens, no merge covers them
    deltas = stream(encode("Hi"), one_by_one(ids))
    assert deltas == ["", "", "", "🙂", ""]


def test_multibyte_text_never_streams_a_partial_character():
    text = "héllo 世界 🙂 naïve café 👩‍👩‍👧"
    deltas = stream([], one_by_one(encode(text)))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_first_token_keeps_its_leading_space():
    prompt = encode("Once upon a time")
    ids = encode(" there was")
    deltas = stream(prompt, one_by_one(ids))
    assert deltas[0].startswith(" ")
    assert "".join(deltas) == " there was"


def test_pushing_many_tokens_at_once_equals_one_by_one():
    ids = encode("The weather today is sunny, 晴れ 🙂!")
    assert stream([], [ids]) == ["The weather today is sunny, 晴れ 🙂!", ""]
    assert "".join(stream([], one_by_one(ids))) == TOKENIZER.decode(ids)


def test_special_tokens_skipped_or_kept():
    ids = encode("Done.") + [2]
    assert "".join(stream([], one_by_one(ids), skip=True)) == "Done."
    assert "".join(stream([], one_by_one(ids), skip=False)) == "Done.<|im_end|>"


def test_flush_emits_an_incomplete_character_as_replacement():
    partial = encode("🙂")[:2]
    deltas = stream([], one_by_one(partial))
    assert deltas[:-1] == ["", ""]
    assert deltas[-1] == TOKENIZER.decode(partial)
    assert "\ufffd" in deltas[-1]


def test_flush_with_nothing_held_is_empty():
    detok = IncrementalDetokenizer(TOKENIZER, encode("Hi"))
    assert detok.flush() == ""
    assert detok.push(encode(" there")) == " there"
    assert detok.flush() == ""


def test_prompt_ending_inside_a_character_does_not_leak_into_output():
    whole = encode("x🙂")
    prompt, generated = whole[:-2], whole[-2:]
    deltas = stream(prompt, one_by_one(generated))
    assert "".join(deltas) == TOKENIZER.decode(generated)


def test_empty_push_returns_nothing():
    detok = IncrementalDetokenizer(TOKENIZER, [])
    assert detok.push([]) == ""
    assert detok.push(encode("a")) == "a"
    assert detok.push([]) == ""


# Ids drawn to exercise the hard cases: partial bytes and special tokens, not just any id.
token_id = st.one_of(
    st.integers(0, VOCAB - 1),
    st.sampled_from(PARTIAL_BYTE_IDS),
    st.sampled_from(SPECIAL_IDS),
)


@st.composite
def chunked(draw, ids_strategy):
    ids = draw(ids_strategy)
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=len(ids))))
    bounds = [0, *cuts, len(ids)]
    return ids, [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(token_id, max_size=8),
    ids_and_chunks=chunked(st.lists(token_id, max_size=40)),
    skip=st.booleans(),
)
def test_random_tokens_concatenate_to_full_decode(prompt, ids_and_chunks, skip):
    ids, chunks = ids_and_chunks
    deltas = stream(prompt, chunks, skip=skip)
    assert "".join(deltas) == TOKENIZER.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40), prompt_text=st.text(max_size=10), data=st.data())
def test_random_text_streams_exactly(text, prompt_text, data):
    ids = encode(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids))))
    bounds = [0, *cuts, len(ids)]
    deltas = stream(encode(prompt_text), [ids[a:b] for a, b in zip(bounds, bounds[1:])])
    assert "".join(deltas) == TOKENIZER.decode(ids, skip_special_tokens=True)
    if not set(ids) & set(SPECIAL_IDS):  # text naming a special token encodes it as one
        assert "".join(deltas) == text
    # Valid text never needs a replacement character, so none is streamed.
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


def with_added_special() -> tuple[object, int]:
    """The tiny tokenizer plus an added token marked special that is not among its
    all_special_ids (as SmolLM2's <file_sep>): decode skips it all the same."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken("<file_sep>", special=True)])
    added = tokenizer.convert_tokens_to_ids("<file_sep>")
    assert added not in tokenizer.all_special_ids
    return tokenizer, added


class CountingTokenizer:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.decoded, self.hf = 0, tokenizer
        self.all_special_ids, self.added_tokens_decoder = tokenizer.all_special_ids, tokenizer.added_tokens_decoder

    def decode(self, ids, skip_special_tokens):
        self.decoded += len(ids)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("held", ["lone byte", "special", "added special"])
def test_a_long_run_of_held_tokens_costs_linear_time(held):
    """A client can bias the model onto a lone byte or a skipped special token for thousands
    of tokens: each push must decode a bounded window, not everything held so far."""
    hf, added = with_added_special()
    token = {"lone byte": PARTIAL_BYTE_IDS[0], "special": SPECIAL_IDS[0], "added special": added}[held]
    tokenizer = CountingTokenizer(hf)
    detok = IncrementalDetokenizer(tokenizer, encode("Hi"))
    n = 2000
    deltas = [detok.push([token]) for _ in range(n)] + [detok.flush()]
    assert "".join(deltas) == hf.decode([token] * n, skip_special_tokens=True)
    assert tokenizer.decoded < 20 * n


def test_an_added_special_token_is_skipped_like_the_others():
    hf, added = with_added_special()
    ids = encode("A") + [added] + encode("🙂")
    for skip in (True, False):
        detok = IncrementalDetokenizer(hf, [], skip_special_tokens=skip)
        assert "".join([detok.push([i]) for i in ids] + [detok.flush()]) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("n_prompt", [0, 1, 5, 20])
def test_prompt_length_does_not_change_output(n_prompt):
    prompt = encode("In the beginning of the year the school starts again")[:n_prompt]
    ids = encode(" and the children go back to class. 🙂")
    assert "".join(stream(prompt, one_by_one(ids))) == TOKENIZER.decode(ids)
