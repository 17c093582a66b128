"""`tools` and `tool_choice` of /v1/chat/completions: the constraint each choice puts on the output, and the
tool calls read back from it.

  none              no calls; the output is content
  required          the grammar forces a JSON array of calls [{"name": ..., "parameters": {...}}, ...],
                    each name one of the tools and its parameters valid for that tool (vLLM's format)
  {"function": X}   the grammar forces X's arguments (a JSON object valid for X's parameters)
  auto (default)    unconstrained; the router's --tool-call-parser reads calls out of the text
The tools also reach the chat template (its `tools` argument), so the model is told about them.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from engine.sampling_params import InvalidParameter
from router.openai.tool_parsers import ParsedCall, make_parser

ANY_OBJECT = {"type": "object"}


class FunctionDef(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


@dataclass
class ToolMode:
    """How one request's output becomes tool calls."""

    kind: str
    """"required", "named" or "auto"."""
    function: str | None = None
    """named: the function whose arguments the output is."""
    parser: str | None = None
    """auto: the --tool-call-parser."""

    def calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole output."""
        if self.kind == "named":
            return None, [ParsedCall(self.function, text)]
        if self.kind == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut short (max_tokens): no complete calls
            return None, [ParsedCall(i["name"], json.dumps(i["parameters"])) for i in items]
        return make_parser(self.parser).parse(text)


def tool_mode(tools: list[ToolDef] | None, tool_choice, parser: str | None) -> ToolMode | None:
    """The request's tool mode (None: no tools, or tool_choice "none"); raises InvalidParameter."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise InvalidParameter("tool_choice", "needs tools")
    if not tools or tool_choice == "none":
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "function names must be unique")
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise InvalidParameter("tool_choice", f"function {tool_choice.function.name!r} is not among the tools")
        return ToolMode("named", function=tool_choice.function.name)
    if tool_choice == "required":
        return ToolMode("required")
    if parser is None:
        raise InvalidParameter("tool_choice", '"auto" needs the router started with --tool-call-parser')
    return ToolMode("auto", parser=parser)


def constraint_schema(mode: ToolMode, tools: list[ToolDef]) -> dict | None:
    """The JSON schema the output must follow (None: unconstrained)."""
    if mode.kind == "named":
        return next(t.function.parameters or ANY_OBJECT for t in tools if t.function.name == mode.function)
    if mode.kind == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": t.function.parameters or ANY_OBJECT},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return None


def tool_call_body(call: ParsedCall, index: int | None = None) -> dict:
    body = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}
