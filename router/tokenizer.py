"""The router's tokenizer: prompts and chat messages to token ids, token ids to text."""

import json
import threading
from collections.abc import Sequence
from pathlib import Path

from jinja2 import TemplateError, TemplateSyntaxError, UndefinedError

from router.hf_tokenizer import FastTokenizer
from tandem.errors import FailedPrecondition, InvalidArgument

CHAT_ROLES = ("system", "user", "assistant")


class Tokenizer:
    def __init__(self, model_dir: Path):
        self.hf = FastTokenizer(model_dir)  # not transformers': it would import torch into the router
        self.eos_token_ids = _eos_ids(Path(model_dir), self.hf)
        # The first call turns off a truncation or padding its tokenizer.json may set, a write to
        # the Rust tokenizer; made here, so that later encodes (in threads) and decodes (on the
        # event loop) only read it and may run side by side.
        self.hf("warm-up")
        self._grammars = None  # tandem.structured's backend, made at the first structured request
        self._grammars_lock = threading.Lock()

    def grammars(self, vocab_size: int):
        """The grammar backend of this tokenizer for the target's vocabulary (0.2 s to make for
        49k tokens; its compiled grammars are cached by content). Requests convert in threads."""
        with self._grammars_lock:
            if self._grammars is None or self._grammars.vocab_size != vocab_size:
                from tandem.structured.llguidance_backend import LlguidanceBackend

                self._grammars = LlguidanceBackend(self.hf.to_json(), vocab_size, self.eos_token_ids)
            return self._grammars

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.hf(text)["input_ids"])

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Renders the model's chat template, ending with the assistant's turn."""
        if self.hf.chat_template is None:
            raise InvalidArgument("messages: this model has no chat template; send a prompt")
        for i, (role, _) in enumerate(messages):
            if role not in CHAT_ROLES:
                raise InvalidArgument(f"messages[{i}].role = {role!r}: must be one of {CHAT_ROLES}")
        chat = [{"role": r, "content": c} for r, c in messages]
        try:
            text = self.hf.apply_chat_template(chat, add_generation_prompt=True)
        except (TemplateSyntaxError, UndefinedError) as e:  # the template itself is broken
            raise FailedPrecondition(f"the model's chat template fails: {e}") from e
        except TemplateError as e:  # its raise_exception: e.g. turns that do not alternate
            raise InvalidArgument(f"messages: the model's chat template refused them: {e}") from e
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)


def _eos_ids(model_dir: Path, hf) -> frozenset[int]:
    """eos ids from generation_config.json (which may list several), else the tokenizer's."""
    ids: set[int] = set()
    path = model_dir / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if hf.eos_token_id is not None:
        ids.add(hf.eos_token_id)
    return frozenset(ids)
