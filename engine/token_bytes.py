"""Each token's bytes, for byte-level BPE tokenizers (GPT-2's alphabet: SmolLM2, Llama 3, Qwen, gpt-oss...).

Their decode is concatenative: a sequence's text is the UTF-8 decoding of its tokens' bytes joined (special
tokens skipped). With a table of every token's bytes, streaming text needs no decode call per token: an
incremental UTF-8 decoder turns each token's bytes into the characters they complete (engine/detokenizer.py).
`token_byte_table` builds the table, then checks it against the tokenizer's own decode on random sequences
and every added token; any disagreement (another decoder, added tokens decoded otherwise) means None, and the
detokenizer decodes windows of tokens as before.
"""
from __future__ import annotations

import random


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_byte_table(backend, vocab_size: int, checks: int = 300) -> list[bytes] | None:
    """Bytes of every token id below `vocab_size` (b"" for special tokens), or None when `backend` (a
    `tokenizers.Tokenizer`) is not byte-level BPE or its decode disagrees with the table."""
    from tokenizers import decoders
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    to_latin1 = str.maketrans({c: chr(b) for c, b in _byte_alphabet().items()})  # then one byte per character
    added = backend.get_added_tokens_decoder()
    table = [b""] * vocab_size
    try:
        for piece, token_id in backend.get_vocab(with_added_tokens=False).items():
            if token_id < vocab_size:
                table[token_id] = piece.translate(to_latin1).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the byte alphabet: not a byte-level vocabulary
        return None
    for token_id, token in added.items():
        if token_id < vocab_size:
            table[token_id] = b"" if token.special else token.content.encode()
    rng = random.Random(0)
    samples = [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(checks)]
    samples += [[i] for i in added if i < vocab_size] + [[rng.randrange(vocab_size), i, rng.randrange(vocab_size)]
                                                         for i in added if i < vocab_size]
    for ids in samples:
        if b"".join(table[i] for i in ids).decode("utf-8", "replace") != backend.decode(ids, skip_special_tokens=True):
            return None
    return table
