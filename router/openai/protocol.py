"""OpenAI request bodies (plus vLLM's extras) and their mapping onto pdserve.v1.GenerateRequest.

The HTTP front only translates: a body becomes the same GenerateRequest the gRPC
front receives, and RequestBuilder validates and tokenizes it. Field names in
its errors are mapped back to the OpenAI parameter names (`openai_param`).
Unknown fields are ignored, as OpenAI servers do; fields pdserve does not
implement are accepted only at their neutral value.
"""
from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from common.protocol import generate_pb2
from engine.sampling_params import InvalidParameter, SamplingParams
from router.openai.structured import (
    JsonSchemaFormat,
    ResponseFormat,
    StructuredFields,
    StructuredOutputs,
    set_constraint,
)
from router.openai.tools import (
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolDef,
    ToolMode,
    constraint_schema,
    tool_mode,
)

Int32 = Annotated[int, Field(ge=-2 ** 31, le=2 ** 31 - 1)]
Int64 = Annotated[int, Field(ge=-2 ** 63, le=2 ** 63 - 1)]

# Parameters without an implementation here, and the values that mean "off".
NEUTRAL_VALUES = {"echo": (False, None), "suffix": (None, ""), "best_of": (None, 1)}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_tokens", "seed", "n")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationBody(StructuredFields):
    """Fields common to /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(extra="allow")
    _constraint_param: str | None = PrivateAttr(default=None)

    model: str | None = None
    n: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: Int32 | None = None
    min_tokens: Int32 | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    cache_salt: str | None = None
    """vLLM's extra field: prefix-cache blocks are shared only between requests with the same salt."""
    prompt_logprobs: Int32 | None = None
    """vLLM's extra field: each prompt token's logprob and this many alternatives (`choices[i].prompt_logprobs`)."""

    def check_text(self) -> None:
        """Raise InvalidParameter naming the first string UTF-8 cannot encode: JSON may carry a lone
        surrogate ("\\ud800"), which protobuf, the tokenizer and a JSON response (even an error's) cannot."""
        path = _unencodable(self.model_dump())
        if path is not None:
            raise InvalidParameter(path, "text that cannot be encoded as UTF-8 (a lone surrogate)")

    def to_generate_request(self, request_id: str, tool_call_parser: str | None = None) -> generate_pb2.GenerateRequest:
        """The GenerateRequest the gRPC front would receive; raises InvalidParameter (OpenAI names)."""
        for name, value in (self.model_extra or {}).items():
            if name in NEUTRAL_VALUES and value not in NEUTRAL_VALUES[name]:
                raise InvalidParameter(name, "not supported by pdserve")
        params = generate_pb2.SamplingParams(ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids or [])
        for name in _SAMPLING_FIELDS:
            if getattr(self, name) is not None:
                setattr(params, name, getattr(self, name))
        if self.stop is not None:
            params.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        if self.requested_max_tokens is not None:
            params.max_tokens = self.requested_max_tokens
        if self.num_logprobs is not None:
            params.logprobs = self.num_logprobs
        if self.prompt_logprobs is not None:
            params.prompt_logprobs = self.prompt_logprobs
        self._constraint_param = self.set_sampling_edits(params)
        self.set_tool_constraint(params, tool_call_parser)
        msg = generate_pb2.GenerateRequest(request_id=request_id, params=params, cache_salt=self.cache_salt or "")
        self.set_input(msg)
        return msg

    def common_param(self, field: str) -> str:
        """The OpenAI name of a RequestBuilder field both bodies share (a constraint: where it came from)."""
        if field.startswith("params.structured_output") and self._constraint_param:
            return self._constraint_param
        return field.removeprefix("params.")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationBody):
    default_max_tokens: ClassVar[int | None] = SamplingParams.max_tokens
    """What an unset max_tokens means (None: the rest of the context)."""

    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    max_tokens: Int32 | None = None
    logprobs: Int32 | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def set_tool_constraint(self, params: generate_pb2.SamplingParams, tool_call_parser: str | None) -> None:
        """Completions have no tools."""

    def set_input(self, msg: generate_pb2.GenerateRequest) -> None:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidParameter("prompt", "batches of prompts are not supported: send one request per prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            msg.text = prompt
        else:
            msg.tokens.ids.extend(prompt)

    def openai_param(self, field: str) -> str:
        if field in ("input", "text", "tokens.ids"):
            return "prompt"
        return self.common_param(field)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_GenerationBody):
    default_max_tokens: ClassVar[int | None] = None

    messages: list[ChatMessage]
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    _tool_mode: ToolMode | None = PrivateAttr(default=None)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def set_input(self, msg: generate_pb2.GenerateRequest) -> None:
        msg.chat.messages.extend(generate_pb2.ChatMessage(
            role=m.role, content=message_text(m.content), tool_call_id=m.tool_call_id or "",
            tool_calls_json=json.dumps(m.tool_calls) if m.tool_calls else "") for m in self.messages)
        if self.tools:
            msg.chat.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in self.tools])

    def set_tool_constraint(self, params: generate_pb2.SamplingParams, tool_call_parser: str | None) -> None:
        """The tool mode of the request, and the constraint `required` or a named function puts on the output."""
        self._tool_mode = tool_mode(self.tools, self.tool_choice, tool_call_parser)
        schema = constraint_schema(self._tool_mode, self.tools) if self._tool_mode else None
        if schema is None:
            return
        if self._constraint_param is not None:
            raise InvalidParameter("tool_choice", f"a required or named tool choice cannot be combined with "
                                                  f"{self._constraint_param}")
        set_constraint(params, "json_schema", schema)
        self._constraint_param = "tool_choice"

    @property
    def tool_mode(self) -> ToolMode | None:
        return self._tool_mode

    def openai_param(self, field: str) -> str:
        if field in ("input", "chat.messages") or field.startswith("chat.messages["):
            return field.removeprefix("chat.") if field != "input" else "messages"
        if field == "params.max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if field == "params.logprobs":
            return "top_logprobs"
        return self.common_param(field)


def message_text(content: str | list[TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def _unencodable(value, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string, or dict key, in a JSON value that UTF-8
    cannot encode; None if there is none."""
    if isinstance(value, dict):
        pairs = [(f"{path}.{_escaped(k)}" if path else _escaped(k), k, v) for k, v in value.items()]
    elif isinstance(value, list):
        pairs = [(f"{path}[{i}]", "", v) for i, v in enumerate(value)]
    else:
        return path if isinstance(value, str) and not _encodable(value) else None
    for inner, key, item in pairs:
        found = inner if not _encodable(key) else _unencodable(item, inner)
        if found is not None:
            return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[Int64]


# Names a validation error's location may use (the rest are pydantic's union member tags).
BODY_FIELDS = frozenset(name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart,
                                           StreamOptions, ResponseFormat, JsonSchemaFormat, StructuredOutputs,
                                           ToolDef, FunctionDef, NamedToolChoice, NamedFunction,
                                           TokenizeRequest, DetokenizeRequest)
                        for name in model.model_fields) | {"schema", "json"}
