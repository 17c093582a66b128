"""Structured output and logits-edit parameters of the OpenAI bodies, onto pdserve.v1.SamplingParams.

Structured output can be asked for OpenAI's way (`response_format`: json_object, or json_schema with
`strict`; the constraint is enforced by the grammar either way) or vLLM's (`structured_outputs`, or the
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`); at most one per request.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from common.protocol import generate_pb2
from engine.sampling_params import InvalidParameter

GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                           "json_object": "json_object"}
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra: one of its keys."""
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """Mixed into the request bodies."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None

    def constraints(self) -> list[tuple[str, str, object]]:
        """(OpenAI parameter, kind, value) of every structured-output request in the body."""
        found = []
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                found.append(("response_format", "json_object", None))
            elif self.response_format.json_schema is None:
                raise InvalidParameter("response_format", "type json_schema needs a json_schema object")
            else:
                found.append(("response_format", "json_schema", self.response_format.json_schema.json_schema))
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                found.append((name, kind, getattr(self, name)))
        if self.structured_outputs is not None:
            for key, kind in STRUCTURED_OUTPUTS_KEYS.items():
                value = getattr(self.structured_outputs, "json_" if key == "json" else key)
                if value is not None and value is not False:
                    found.append((f"structured_outputs.{key}", kind, value))
        return found

    def set_sampling_edits(self, params: generate_pb2.SamplingParams) -> str | None:
        """Set the penalties, biases, bad words and the constraint; the constraint's parameter name (for errors)."""
        for name in PENALTY_FIELDS:
            if getattr(self, name) is not None:
                setattr(params, name, getattr(self, name))
        if self.logit_bias:
            try:
                params.logit_bias.update({int(k): v for k, v in self.logit_bias.items()})
            except (ValueError, OverflowError):
                raise InvalidParameter("logit_bias", "keys must be token ids (integers as strings)") from None
        if self.bad_words:
            params.bad_words.extend(self.bad_words)
        found = self.constraints()
        if len(found) > 1:
            raise InvalidParameter(found[1][0], f"only one structured output per request; {found[0][0]} is set")
        if not found:
            return None
        source, kind, value = found[0]
        set_constraint(params, kind, value)
        return source


def set_constraint(params: generate_pb2.SamplingParams, kind: str, value) -> None:
    if kind == "json_object":
        params.json_object = True
    elif kind == "choice":
        params.choice.choices.extend(value)
    elif kind == "json_schema":
        params.json_schema = value if isinstance(value, str) else json.dumps(value)
    else:
        setattr(params, kind, value)
