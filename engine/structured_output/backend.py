"""llguidance behind the engine: grammars from StructuredOutput, a compile cache, and a matcher per sample.

Why llguidance (bench/grammar_backends.py, BENCHMARKS.md "Structured outputs"): on SmolLM2's 49k-token
vocabulary it compiled the 10 test schemas and filled a batch-64 step's masks several times faster than
xgrammar, rolls back and validates draft tokens (speculative decoding), and has no dependencies of its own.
Its one cost, building its view of the tokenizer (0.3-1.5 s for SmolLM2's), is paid once, on the compile
thread, when the first constrained request arrives.

Compiling here means building a template matcher (llguidance parses and checks the grammar, and builds
its lexer lazily as masks are computed): templates are cached by the constraint, and each sample's
matcher is a copy of its template. Compiles run on a thread of their own, never the engine's step.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from engine.errors import InvalidParameter
from engine.structured_output.spec import StructuredOutput

JSON_DEFAULTS = {"whitespace_flexible": False}
"""JSON without free whitespace (a constrained model cannot pad an answer with endless spaces), as vLLM does."""
CACHE_SIZE = 256
"""Compiled constraints kept (least recently used dropped first)."""


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for a constraint (not yet checked: `check` or a compile does that)."""
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_DEFAULTS)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
    except ValueError as exc:
        raise InvalidParameter(spec.field, str(exc)) from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
    try:  # Lark as it is; GBNF / EBNF (as llama.cpp and xgrammar write it) converted to Lark
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.value))
    except GbnfToLarkError as exc:
        raise InvalidParameter(spec.field, f"does not compile: {exc}") from None


def check(spec: StructuredOutput) -> None:
    """Raise InvalidParameter naming the field when the constraint does not compile (no tokenizer needed:
    the router calls this before any worker is touched)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_text(spec))
    if error:
        raise InvalidParameter(spec.field, f"does not compile: {error}")


class SampleGrammar:
    """One sample's matcher: advanced by each accepted token, rolled back after a draft check."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a token; False when the grammar forbids it (the matcher is then in error)."""
        return self._matcher.consume_token(token_id)

    def fill(self, bitmask, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 CPU bitmask (rows, ceil(vocab / 32))."""
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def num_valid(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would accept from here (nothing is consumed)."""
        return self._matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (but EOS)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarBackend:
    """Compiles constraints (cached, on a thread of its own) and hands out per-sample matchers."""

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()

    def compile_future(self, spec: StructuredOutput) -> Future:
        """The template matcher of `spec`, compiled once (a Future; its exception is an InvalidParameter)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is None or self._forget(spec, f))
        return future

    def matcher(self, spec: StructuredOutput, timeout_s: float | None = None) -> SampleGrammar:
        """A fresh matcher for one sample (compiling first if no caller did, waiting at most `timeout_s`)."""
        future = self.compile_future(spec)
        try:
            template = future.result(timeout=timeout_s)
        except TimeoutError:
            raise InvalidParameter(spec.field, f"compiling took longer than {timeout_s:g}s") from None
        return SampleGrammar(template.deep_copy())

    def allocate_bitmask(self, rows: int):
        """An int32 bitmask of `rows` rows, every token allowed."""
        import torch
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        if self._ll_tokenizer is None:
            from llguidance.hf import from_tokenizer  # imports transformers: not needed by the router's checks
            self._ll_tokenizer = from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        template = llguidance.LLMatcher(self._ll_tokenizer, grammar_text(spec), log_level=0)
        if template.is_error():
            raise InvalidParameter(spec.field, f"does not compile: {template.get_error()}")
        return template

    def _forget(self, spec: StructuredOutput, future: Future) -> None:
        """A failed compile is not cached (the next request with it gets the error afresh)."""
        with self._lock:
            if self._cache.get(spec) is future:
                del self._cache[spec]
