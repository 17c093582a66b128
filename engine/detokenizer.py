"""Incremental detokenization with stop strings, never splitting a UTF-8 character.

Text is decoded over a short window of recent tokens; new text is released only
once it no longer ends in an incomplete character (U+FFFD). With a byte-level BPE
tokenizer (`Tokenizer.token_bytes`), each token's bytes go through an incremental
UTF-8 decoder instead: the same text, no decode call per token. While stop strings
are set, the last (longest stop - 1) characters are held back, so a stop string
is never partly emitted before it is recognised.
"""
from __future__ import annotations

import codecs

from engine.tokenizer import Tokenizer

_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self._tok = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self._bytes = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._bytes is not None else None

    def add_token(self, token_id: int) -> str | None:
        """Append a token; return the stop string if one now appears (text cut before it)."""
        if self._utf8 is not None:
            piece = self._utf8.decode(self._bytes[token_id] if token_id < len(self._bytes) else b"")
            if not piece:
                return None
            old_len = len(self.text)
            self.text += piece
            return self._find_stop(old_len)
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        old_len = len(self.text)
        self.text += full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._find_stop(old_len)

    def flush(self) -> None:
        """At the end, release text still waiting for more bytes."""
        if self._utf8 is not None:
            self.text += self._utf8.decode(b"", final=True)
            return
        tail = self._tok.decode(self._ids[self._prefix_offset:])
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        if len(tail) > len(prefix):
            self.text += tail[len(prefix):]
        self._read_offset = self._prefix_offset = len(self._ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out (all of it once finished)."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def _find_stop(self, old_len: int) -> str | None:
        found = None
        for stop in self._stop:
            at = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if at != -1 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return None
        self.text = self.text[:found[0]]
        return found[1]
