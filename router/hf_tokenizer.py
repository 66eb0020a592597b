"""A Hugging Face fast tokenizer's folder read without transformers: `tokenizers` (Rust) for
encoding and decoding, jinja2 for the chat template, rendered as transformers renders it.

transformers imports torch whenever torch is installed, and the router, which never carries a
tensor, would pay its import (over a second) and most of its memory for a tokenizer. This is
the subset of `PreTrainedTokenizerFast` the router uses; tests/unit/test_router_tokenizer.py
holds it equal to transformers' on the models we serve."""

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' chat template environment (utils/chat_template_utils.py)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's (a string, or named templates: "default")."""
    path = folder / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (for tokenizers whose config asks for it)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class FastTokenizer:
    """Encode, decode, special tokens and the chat template of a tokenizer folder."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        self._rust = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        self.special_tokens_map = {k: c for k in SPECIAL_KEYS if (c := _content(config.get(k))) is not None}
        extra = [_content(t) for t in config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
                 if isinstance(t, (str, dict))]
        named = [*self.special_tokens_map.values(), *extra]
        self.all_special_ids = sorted({i for t in named if (i := self._rust.token_to_id(t)) is not None})
        self.added_tokens_decoder = self._rust.get_added_tokens_decoder()
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = self._rust.token_to_id(eos) if eos is not None else None
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = _chat_template(folder, config)
        self._template = None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (with what the first call turned off)."""
        return self._rust.to_str()

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self._rust.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as text (tokenize it with add_special_tokens=False). Raises jinja2's
        TemplateSyntaxError for a broken template, TemplateError for one that refuses."""
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens_map)
