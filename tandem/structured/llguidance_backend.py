"""The grammar backend on llguidance (MIT; JSON Schema, regex, Lark, choice lists).

Its traps, kept out of callers' way here and in matcher.py: a matcher never raises for a bad
grammar or token, it enters an error state for good (so the compile checks `is_error`, and the
target validates every token before consuming it); and EOS consumed after the grammar stopped is
not counted by `rollback` (matcher.py never feeds it). Compiling builds a matcher; a new
sequence's matcher is a `deep_copy` of the cached one (microseconds, not the compile's
milliseconds). Torch-free: the router compiles to check a request.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance

from tandem.errors import InvalidArgument
from tandem.structured.spec import StructuredOutput

# Caps on one compile (llguidance's fuel: lexer ~50k a ms, Earley items ~20k a ms), so that a
# hostile schema costs a bounded time; the defaults are 1M fuel and 500k grammar symbols.
COMPILE_LIMITS = dict(initial_lexer_fuel=1_000_000, max_grammar_size=200_000, step_lexer_fuel=200_000,
                      step_max_items=50_000, max_lexer_states=250_000)
# A wall-clock cap on a whole compile (the schema's conversion and the matcher's construction),
# beside the fuel: what fuel does not meter (a huge schema's conversion, a loaded machine) still
# ends. Compiles measured here take 1-15 ms; the abandoned compile finishes on its own thread.
COMPILE_TIMEOUT_S = 1.0
# JSON's free whitespace, by default: none, and json.dumps's separators. llguidance's default
# (any run of spaces and newlines between tokens) lets a small model pad its output with
# whitespace until max_tokens; one canonical layout also makes more tokens forced. A schema's
# "x-guidance" overrides these (defaults -> x-guidance -> nothing).
JSON_DEFAULTS = dict(whitespace_flexible=False, item_separator=", ", key_separator=": ")
CACHE_SIZE = 128
_MAX_MESSAGE = 600  # a compiler message goes back in a status: keep it short


@dataclass(frozen=True)
class CompiledGrammar:
    spec_key: str
    template: llguidance.LLMatcher  # at the start state; never advanced, only copied
    compile_s: float


class LlguidanceMatcher:
    """One sequence's llguidance matcher (backend.Matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def validate(self, tokens: Sequence[int]) -> int:
        return self._m.validate_tokens(list(tokens))

    def consume(self, tokens: Sequence[int]) -> None:
        if not self._m.consume_tokens(list(tokens)):
            raise RuntimeError(f"grammar matcher: consumed an invalid token: {self._m.get_error()}")

    def rollback(self, count: int) -> None:
        if count and not self._m.rollback(count):
            raise RuntimeError(f"grammar matcher: rollback of {count} failed: {self._m.get_error()}")

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    def fill_bitmask(self, address: int, num_bytes: int) -> None:
        self._m.unsafe_compute_mask_ptr(address, num_bytes)  # drops the GIL

    def forced_tokens(self) -> list[int]:
        """backend.ForcingMatcher: the canonical tokens of the bytes the grammar forces from here."""
        return self._m.compute_ff_tokens()


class LlguidanceBackend:
    """backend.GrammarBackend over one tokenizer; compiled grammars in an LRU keyed by the spec's
    text. Thread-safe: the router compiles in its conversion threads."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.eos_token_ids = frozenset(eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError("structured output needs the model's EOS token id")
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(self.eos_token_ids))
        self._limits = llguidance.LLParserLimits(**COMPILE_LIMITS)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, model_dir: Path, vocab_size: int) -> LlguidanceBackend:
        model_dir = Path(model_dir)
        return cls((model_dir / "tokenizer.json").read_text(), vocab_size, model_eos_ids(model_dir))

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        spec.validate()
        key = spec.key
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return hit
        started = time.perf_counter()
        matcher = self._build(spec)
        if matcher.is_error():
            raise InvalidArgument(f"{spec.field}: {_short(matcher.get_error())}")
        compiled = CompiledGrammar(key, matcher, time.perf_counter() - started)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The spec's matcher, built on a thread of its own that the caller waits for at most
        compile_timeout_s (llguidance drops the GIL while it compiles)."""
        box: dict = {}

        def build():
            try:
                box["matcher"] = llguidance.LLMatcher(self._tokenizer, _grammar_text(spec), log_level=0,
                                                      limits=self._limits)
            except BaseException as e:  # noqa: BLE001 (raised again in the caller's thread)
                box["error"] = e

        worker = threading.Thread(target=build, name="grammar-compile", daemon=True)
        worker.start()
        worker.join(self.compile_timeout_s)
        if worker.is_alive():  # left to finish on its own; its result is dropped, never cached
            raise InvalidArgument(f"{spec.field}: compiling took over {self.compile_timeout_s:g} s, the cap on a "
                                  "compile: simplify it")
        if "error" in box:
            raise box["error"]
        return box["matcher"]

    def new_matcher(self, grammar: CompiledGrammar) -> LlguidanceMatcher:
        return LlguidanceMatcher(grammar.template.deep_copy())

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)


def _grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for a spec (not yet checked: the matcher's construction does)."""
    L = llguidance.LLMatcher
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except ValueError as e:
            raise InvalidArgument(f"{spec.field}: not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument(f"{spec.field}: a schema is a JSON object, got {type(schema).__name__}")
        try:
            return L.grammar_from_json_schema(spec.value, defaults=JSON_DEFAULTS)
        except ValueError as e:
            raise InvalidArgument(f"{spec.field}: {_short(str(e))}") from None
    if spec.kind == "json_object":
        return L.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return L.grammar_from_regex(spec.value)
    if spec.kind == "grammar":
        return L.grammar_from_lark(spec.value)
    return llguidance.grammar_from("choice", json.dumps(list(spec.value)))


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MAX_MESSAGE else message[:_MAX_MESSAGE] + "..."


def model_eos_ids(model_dir: Path) -> frozenset[int]:
    """EOS ids as the router stops on them: generation_config.json's (one or several), else
    config.json's."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
            if ids:
                break
    return frozenset(ids)
