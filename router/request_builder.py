"""Turn a GenerateRequest into (request id, prompt token ids, SamplingParams), or say what is wrong.

Every check that does not need a worker happens here, so a bad request is
refused (INVALID_ARGUMENT naming the field) before anything is queued.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from common.protocol import params_from_proto
from engine.model.model_config import ModelConfig
from engine.model_files import resolve_model_path
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.structured_output import backend as grammar_backend
from engine.tokenizer import Tokenizer

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
PROMPT_CHARS_PER_TOKEN = 16
"""Generous characters per token: text longer than max_model_len times this cannot fit the context."""


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""
    """The effective salt of the prompt's blocks (`effective_cache_salt`)."""


def effective_cache_salt(tenant: str | None, client_salt: str) -> str:
    """The salt the workers hash with: the client's, combined with its tenant when API keys are on,
    so two tenants never share a block whatever salts they send."""
    return client_salt if tenant is None else json.dumps([tenant, client_salt])


class RequestBuilder:
    def __init__(self, model: str, max_model_len: int | None = None, max_n: int = 16,
                 max_prompt_chars: int | None = None) -> None:
        path = resolve_model_path(model)
        self.tokenizer = Tokenizer(path)
        model_config = ModelConfig.from_dir(path)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        self.max_n = max_n
        self.max_prompt_chars = max_prompt_chars or self.max_model_len * PROMPT_CHARS_PER_TOKEN

    def build(self, msg, max_tokens_to_context: bool = False, tenant: str | None = None) -> PreparedRequest:
        """Validate and tokenize a pdserve.v1.GenerateRequest; raises InvalidParameter.

        With `max_tokens_to_context`, an unset max_tokens means the rest of the
        context (OpenAI's chat API) instead of 16. `tenant`: the caller's, when API keys are on."""
        request_id = msg.request_id or uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidParameter("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")
        if len(msg.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidParameter("cache_salt", f"longer than {MAX_CACHE_SALT_CHARS} characters")
        if msg.params.HasField("n") and not 1 <= msg.params.n <= self.max_n:
            raise InvalidParameter("params.n", f"must be between 1 and {self.max_n}")
        self.check_size(msg)
        prompt = self.prompt_token_ids(msg)
        params_msg = msg.params
        if max_tokens_to_context and not params_msg.HasField("max_tokens") and len(prompt) < self.max_model_len:
            params_msg = type(params_msg)()
            params_msg.CopyFrom(msg.params)
            params_msg.max_tokens = self.max_model_len - len(prompt)
        try:
            params = params_from_proto(params_msg)
        except InvalidParameter as exc:
            raise InvalidParameter(f"params.{exc.field}", str(exc).split(": ", 1)[1]) from None
        self.check(prompt, params)
        return PreparedRequest(request_id, prompt, params, effective_cache_salt(tenant, msg.cache_salt))

    def check_size(self, msg) -> None:
        """Cheap bounds checked before any tokenizing: a prompt that cannot fit the context is refused
        whatever its tokens would be."""
        kind = msg.WhichOneof("input")
        if kind == "text" and len(msg.text) > self.max_prompt_chars:
            raise InvalidParameter("text", f"{len(msg.text)} characters; at most {self.max_prompt_chars}")
        if kind == "tokens" and len(msg.tokens.ids) >= self.max_model_len:
            # The same field and words as the length check after tokenizing (clients match on them).
            raise InvalidParameter("input", f"the prompt has {len(msg.tokens.ids)} tokens; the context holds "
                                            f"{self.max_model_len} (prompt plus at least one new token)")
        if kind == "chat":
            chars = len(msg.chat.tools_json) + sum(len(m.content) + len(m.role) + len(m.tool_calls_json)
                                                   for m in msg.chat.messages)
            if chars > self.max_prompt_chars:
                raise InvalidParameter("chat.messages", f"{chars} characters; at most {self.max_prompt_chars}")

    def prompt_token_ids(self, msg) -> list[int]:
        kind = msg.WhichOneof("input")
        if kind is None:
            raise InvalidParameter("input", "give one of text, tokens or chat")
        if kind == "text":
            if not msg.text:
                raise InvalidParameter("text", "the prompt is empty")
            return self.tokenizer.encode(msg.text)
        if kind == "tokens":
            ids = list(msg.tokens.ids)
            if not ids:
                raise InvalidParameter("tokens.ids", "the prompt is empty")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidParameter("tokens.ids", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
            return ids
        messages = [chat_message(m) for m in msg.chat.messages]
        if not messages:
            raise InvalidParameter("chat.messages", "no messages")
        for i, m in enumerate(messages):
            if not m["role"]:
                raise InvalidParameter(f"chat.messages[{i}].role", "empty")
        try:
            tools = json.loads(msg.chat.tools_json) if msg.chat.tools_json else None
        except ValueError:
            raise InvalidParameter("chat.tools_json", "is not valid JSON") from None
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools)
        except Exception as exc:  # a template may raise on roles it does not know
            raise InvalidParameter("chat.messages", f"the chat template refused them: {exc}") from None

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Checks that need the model: context length, token ids in the vocabulary."""
        if len(prompt) >= self.max_model_len:
            raise InvalidParameter("input", f"the prompt has {len(prompt)} tokens; the context holds "
                                            f"{self.max_model_len} (prompt plus at least one new token)")
        room = self.max_model_len - len(prompt)
        if params.max_tokens > room:
            raise InvalidParameter("params.max_tokens", f"{params.max_tokens} new tokens do not fit: the prompt has "
                                                        f"{len(prompt)} tokens and the context {self.max_model_len}")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidParameter(f"params.{name}", f"token id {bad} is outside the vocabulary")
        if params.structured_output is not None:
            try:
                grammar_backend.check(params.structured_output)
            except InvalidParameter as exc:
                raise InvalidParameter(f"params.{exc.field}", str(exc).split(": ", 1)[1]) from None


def chat_message(m) -> dict:
    """A ChatMessage as the chat template takes it (tool calls and tool results included when present)."""
    message = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        try:
            message["tool_calls"] = json.loads(m.tool_calls_json)
        except ValueError:
            raise InvalidParameter("chat.messages.tool_calls_json", "is not valid JSON") from None
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message
