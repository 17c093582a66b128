"""What a request constrains its output to: a JSON schema, any JSON object, a regex, a grammar or a choice.

Pure Python (no grammar library): the checks here are the ones that need no compiler; whether a schema
or grammar compiles is the backend's check (engine/structured_output/backend.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.errors import InvalidParameter

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_SPEC_CHARS = 64 * 1024
"""Largest schema, regex or grammar text (and the choices together): compile time grows with it."""
MAX_CHOICES = 256
FIELD = "structured_output"


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint: `kind` is one of KINDS; `value` the schema (JSON text), regex, grammar (Lark/EBNF text),
    or the choices (a tuple of strings); None for json_object."""

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        field = f"{FIELD}.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidParameter(FIELD, f"unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind == "json_object":
            if self.value is not None:
                raise InvalidParameter(field, "takes no value")
            return
        if self.kind == "choice":
            choices = tuple(self.value or ())
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidParameter(field, "must be a non-empty list of non-empty strings")
            if len(choices) > MAX_CHOICES:
                raise InvalidParameter(field, f"at most {MAX_CHOICES} choices")
            if sum(map(len, choices)) > MAX_SPEC_CHARS:
                raise InvalidParameter(field, f"the choices exceed {MAX_SPEC_CHARS} characters")
            object.__setattr__(self, "value", choices)
            return
        if not isinstance(self.value, str) or not self.value.strip():
            raise InvalidParameter(field, "must be a non-empty string")
        if len(self.value) > MAX_SPEC_CHARS:
            raise InvalidParameter(field, f"longer than {MAX_SPEC_CHARS} characters")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as exc:
                raise InvalidParameter(field, f"is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidParameter(field, "must be a JSON object (a JSON schema)")

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        return cls("grammar", text)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutput:
        return cls("choice", tuple(choices))

    @property
    def field(self) -> str:
        """The request field an error about this constraint names."""
        return f"{FIELD}.{self.kind}"
