"""Tokenizer and chat template from the checkpoint directory (no hub access)."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class Tokenizer:
    def __init__(self, path: Path) -> None:
        from engine.tokenizer_loading import load_hf_tokenizer

        self._tok = load_hf_tokenizer(path)
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id
        # The Rust tokenizer itself, when transformers' decode adds nothing to it (no space clean-up):
        # decoding runs twice per generated token, and the Python wrapper costs ~5x the decode.
        backend = getattr(self._tok, "backend_tokenizer", None)
        self._fast_decode = None
        if backend is not None and not getattr(self._tok, "clean_up_tokenization_spaces", False):
            self._fast_decode = backend.decode

    @property
    def token_bytes(self) -> list[bytes] | None:
        """Each token id's bytes when decoding is byte concatenation (byte-level BPE, checked against decode;
        engine/token_bytes.py), else None. Built on first use."""
        if not hasattr(self, "_token_bytes"):
            from engine.token_bytes import token_byte_table
            backend = getattr(self._tok, "backend_tokenizer", None)
            self._token_bytes = None
            if self._fast_decode is not None and backend is not None:
                self._token_bytes = token_byte_table(backend, backend.get_vocab_size())
        return self._token_bytes

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer (grammar libraries build their view of the vocabulary from it)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a chat, ending with the assistant's generation prompt (`tools`: the template's)."""
        if not self._tok.chat_template:
            raise ValueError("messages: this model has no chat template")
        text = self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return self.encode(text)
