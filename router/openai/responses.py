"""Response bodies and server-sent events of /v1/completions and /v1/chat/completions.

`Completions` and `ChatCompletions` know the two JSON shapes; `SseStream` turns the
pipeline's GenerateResponse messages into `data: {...}` events. A chunk that must be
its sample's last (max_tokens reached) is held until the sample's Complete, which
follows at once, so the last token carries finish_reason as in vLLM's server.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from common.client import SampleResult
from common.protocol import finish_reason_name, generate_pb2, logprobs_from_chunk, usage_from_proto
from router.openai.tool_parsers import make_parser
from router.openai.tools import ToolMode, tool_call_body

FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length", "abort": "abort", "error": "error"}


def usage_body(usages: list[dict]) -> dict:
    """One request's usage from its samples' (the prompt counts once; cached_tokens: what every sample reused)."""
    prompt = usages[0]["prompt_tokens"] if usages else 0
    completion = sum(u["completion_tokens"] for u in usages)
    cached = min((u["cached_tokens"] for u in usages), default=0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Api:
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, token_text: Callable[[int], str]) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text

    def envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def response(self, samples: list[SampleResult], want_logprobs: bool) -> dict:
        choices = [self.choice(s, want_logprobs) for s in samples]
        for choice, s in zip(choices, samples, strict=True):
            if s.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs(s.prompt_logprobs)
        body = self.envelope(self.object_name, choices)
        body["usage"] = usage_body([s.usage for s in samples])
        return body


    def prompt_logprobs(self, entries: list[dict]) -> list[dict | None]:
        """vLLM's shape: None for the first prompt token, then per token {token id: {logprob, rank,
        decoded_token}} for the token itself and the alternatives (rank given for the token itself)."""
        body: list[dict | None] = [None]
        for e in entries:
            tokens = {str(t["token_id"]): {"logprob": t["logprob"], "decoded_token": self.token_text(t["token_id"])}
                      for t in e["top_logprobs"]}
            tokens[str(e["token_id"])] = {"logprob": e["logprob"], "rank": e["rank"],
                                          "decoded_token": self.token_text(e["token_id"])}
            body.append(tokens)
        return body


class Completions(_Api):
    object_name = chunk_object_name = "text_completion"

    def choice(self, s: SampleResult, want_logprobs: bool) -> dict:
        return {"index": s.index, "text": s.text, "logprobs": self.logprobs(s.logprobs) if want_logprobs else None,
                "finish_reason": FINISH_REASONS[s.finish_reason]}

    def chunk_choice(self, index: int, text: str, logprobs: list[dict] | None, finish_reason: str | None,
                     first: bool) -> dict:
        return {"index": index, "text": text, "logprobs": None if logprobs is None else self.logprobs(logprobs),
                "finish_reason": finish_reason}

    def logprobs(self, entries: list[dict]) -> dict:
        tokens = [self.token_text(e["token_id"]) for e in entries]
        offsets, offset = [], 0
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self.token_text(t["token_id"]): t["logprob"] for t in e["top_logprobs"]}
                                 for e in entries],
                "text_offset": offsets}


class ChatCompletions(_Api):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, s: SampleResult, want_logprobs: bool) -> dict:
        return {"index": s.index, "message": {"role": "assistant", "content": s.text},
                "logprobs": self.logprobs(s.logprobs) if want_logprobs else None,
                "finish_reason": FINISH_REASONS[s.finish_reason]}

    def chunk_choice(self, index: int, text: str, logprobs: list[dict] | None, finish_reason: str | None,
                     first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or logprobs else {})
        return {"index": index, "delta": delta, "logprobs": None if logprobs is None else self.logprobs(logprobs),
                "finish_reason": finish_reason}

    def logprobs(self, entries: list[dict]) -> dict:
        return {"content": [dict(self._token(e["token_id"], e["logprob"]),
                                 top_logprobs=[self._token(t["token_id"], t["logprob"]) for t in e["top_logprobs"]])
                            for e in entries]}

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


class SseStream:
    """Events of one streamed request, fed the pipeline's messages in order."""

    def __init__(self, api: _Api, want_logprobs: bool, include_usage: bool, max_tokens: int | None) -> None:
        self.api = api
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.max_tokens = max_tokens
        self._num_tokens: dict[int, int] = {}
        self._held: dict[int, tuple[generate_pb2.Chunk, bool]] = {}
        self._usages: list[dict] = []

    def on_message(self, msg: generate_pb2.GenerateResponse) -> list[str]:
        index = msg.index
        if msg.HasField("chunk"):
            first = index not in self._num_tokens
            self._num_tokens[index] = self._num_tokens.get(index, 0) + len(msg.chunk.token_ids)
            if self._num_tokens[index] == self.max_tokens:
                self._held[index] = (msg.chunk, first)  # the sample's last chunk: its Complete follows at once
                return []
            return [self._event(index, msg.chunk, None, first)]
        self._usages.append(usage_from_proto(msg.complete.usage))
        reason = FINISH_REASONS[finish_reason_name(msg.complete.finish_reason)]
        chunk, first = self._held.pop(index, (None, index not in self._num_tokens))
        return [self._event(index, chunk, reason, first)]

    def end(self) -> list[str]:
        events = []
        if self.include_usage:
            body = self.api.envelope(self.api.chunk_object_name, [])
            body["usage"] = usage_body(self._usages)
            events.append(sse(body))
        return events + [sse("[DONE]")]

    def _event(self, index: int, chunk: generate_pb2.Chunk | None, finish_reason: str | None, first: bool) -> str:
        text = chunk.text if chunk is not None else ""
        logprobs = (logprobs_from_chunk(chunk) if chunk is not None else []) if self.want_logprobs else None
        body = self.api.envelope(self.api.chunk_object_name,
                                 [self.api.chunk_choice(index, text, logprobs, finish_reason, first)])
        if self.include_usage:
            body["usage"] = None
        return sse(body)


class ToolChatCompletions(ChatCompletions):
    """Chat completions whose output may be tool calls (router/openai/tools.py): `message.tool_calls`, and
    in a stream `delta.tool_calls` as the openai client assembles them (a named function's arguments
    streamed as they come; `required` and parsed calls whole when the sample ends, content before them
    streamed)."""

    def __init__(self, request_id: str, model: str, token_text: Callable[[int], str], mode: ToolMode) -> None:
        super().__init__(request_id, model, token_text)
        self.mode = mode
        self._parser = make_parser(mode.parser) if mode.kind == "auto" else None
        self._text: dict[int, str] = {}
        self._sent: dict[int, int] = {}
        """auto: characters of content streamed so far, per sample."""

    def choice(self, s: SampleResult, want_logprobs: bool) -> dict:
        body = super().choice(s, want_logprobs)
        content, calls = self.mode.calls(s.text)
        body["message"] = {"role": "assistant", "content": content, "tool_calls": [tool_call_body(c) for c in calls]}
        body["finish_reason"] = self._finish_reason(body["finish_reason"], calls)
        return body

    def chunk_choice(self, index: int, text: str, logprobs: list[dict] | None, finish_reason: str | None,
                     first: bool) -> dict:
        delta = {"role": "assistant"} if first else {}
        if self.mode.kind == "named":
            call = {"index": 0, "function": {"arguments": text}}
            if first:
                call.update(id=f"call_{uuid.uuid4().hex[:24]}", type="function")
                call["function"]["name"] = self.mode.function
            if first or text:
                delta["tool_calls"] = [call]
        else:
            whole = self._text[index] = self._text.get(index, "") + text
            calls = self._stream_content(index, whole, delta, finish_reason is not None)
            if calls:
                delta["tool_calls"] = [tool_call_body(c, i) for i, c in enumerate(calls)]
            if finish_reason is not None:
                finish_reason = self._finish_reason(finish_reason, calls)
        return {"index": index, "delta": delta, "logprobs": None if logprobs is None else self.logprobs(logprobs),
                "finish_reason": finish_reason}

    def _stream_content(self, index: int, whole: str, delta: dict, ended: bool) -> list:
        """Put the content that is safe to stream into `delta`; at the end, the calls (if any)."""
        sent = self._sent.get(index, 0)
        calls = []
        if ended:
            content, calls = self.mode.calls(whole)
            upto = len(content or "") if calls else len(whole)
            upto = max(upto, sent)
        elif self.mode.kind == "required":
            upto = sent
        else:
            start = self._parser.marker_at(whole)
            upto = start if start is not None else len(whole) - self._parser.held_back(whole)
        if upto > sent:
            delta["content"] = whole[sent:upto]
            self._sent[index] = upto
        return calls

    def _finish_reason(self, reason: str, calls: list) -> str:
        return "tool_calls" if calls and reason == "stop" and self.mode.kind != "named" else reason
