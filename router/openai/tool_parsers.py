"""Tool calls read out of a model's text, one parser per chat-template family (vLLM's `--tool-call-parser`).

  hermes       Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated
  llama3_json  Llama 3.x: {"name": ..., "parameters": {...}} (after an optional <|python_tag|>), `;`-separated
  mistral      Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

`parse` splits a whole output into content (the text before the calls) and calls; text that does not
parse as calls stays content. `marker_at` tells a stream where calls may start, so content before it is
streamed and the rest held until the sample ends.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ParsedCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's `function.arguments`)."""


def _call(obj) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ParsedCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def _calls(objects) -> list[ParsedCall] | None:
    calls = [_call(o) for o in objects]
    return calls if calls and all(calls) else None


class ToolCallParser:
    markers: tuple[str, ...] = ()

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        start = self.marker_at(text)
        if start is None:
            return text, []
        calls = self._parse_calls(text[start:])
        return (text[:start].rstrip(), calls) if calls else (text, [])

    def marker_at(self, text: str) -> int | None:
        """Where the calls begin in `text` (None: no marker yet)."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` could be the start of a marker (not streamed yet)."""
        return max((n for m in self.markers for n in range(1, len(m)) if text.endswith(m[:n])), default=0)

    def _parse_calls(self, text: str) -> list[ParsedCall] | None:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _parse_calls(self, text):
        try:
            return _calls([json.loads(body) for body in self._block.findall(text)])
        except ValueError:
            return None


class Llama3JsonParser(ToolCallParser):
    markers = ("<|python_tag|>", "{")

    def marker_at(self, text):
        stripped = text.lstrip()
        if stripped.startswith(("<|python_tag|>", "{")):
            return len(text) - len(stripped)
        return None

    def held_back(self, text):
        return len(text) if not text.strip() or "<|python_tag|>".startswith(text.lstrip()) else 0

    def _parse_calls(self, text):
        text = text.strip().removeprefix("<|python_tag|>")
        try:
            return _calls([json.loads(part) for part in _split_top_level(text, ";")])
        except ValueError:
            return None


class MistralParser(ToolCallParser):
    markers = ("[TOOL_CALLS]",)

    def _parse_calls(self, text):
        try:
            objects = json.loads(text.removeprefix("[TOOL_CALLS]").strip())
        except ValueError:
            return None
        return _calls(objects if isinstance(objects, list) else [objects])


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator`s outside JSON strings and brackets."""
    parts, depth, in_string, escaped, start = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def make_parser(name: str) -> ToolCallParser:
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}[name]()
