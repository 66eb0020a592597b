"""What a sequence's output must match, as the sampling params carry it (frozen, torch-free)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tandem.errors import InvalidArgument

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# A spec travels in every AddSequence and ForkSequence of its sequences: keep it small.
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """kind: one of KINDS; value: the text (a schema as JSON text, a regex, a Lark grammar),
    True for json_object, the strings of a choice."""

    kind: str
    value: str | bool | tuple[str, ...]

    @property
    def field(self) -> str:
        """The public field's name, for errors."""
        return f"params.structured_output.{self.kind}"

    @property
    def key(self) -> str:
        """The spec's content as one string: what compiled grammars are cached by."""
        value = json.dumps(list(self.value)) if self.kind == "choice" else str(self.value)
        return f"{self.kind}\n{value}"

    def validate(self) -> None:
        """The checks that need no compiler: raise InvalidArgument naming the field."""
        if self.kind not in KINDS:
            raise InvalidArgument(f"params.structured_output: unknown kind {self.kind!r}, one of {KINDS}")
        size = len(self.key.encode("utf-8"))
        if size > MAX_SPEC_BYTES:
            raise InvalidArgument(f"{self.field} has {size} bytes: at most {MAX_SPEC_BYTES}")
        if self.kind == "json_object":
            if self.value is not True:
                raise InvalidArgument(f"{self.field} = {self.value!r}: set it to true, or set no kind")
        elif self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value:
                raise InvalidArgument(f"{self.field}.values is empty: list at least one string")
            if len(self.value) > MAX_CHOICES:
                raise InvalidArgument(f"{self.field}.values has {len(self.value)} strings: at most {MAX_CHOICES}")
            if any(not v for v in self.value):
                raise InvalidArgument(f"{self.field}.values holds an empty string")
        elif not isinstance(self.value, str) or not self.value.strip():
            raise InvalidArgument(f"{self.field} is empty")
