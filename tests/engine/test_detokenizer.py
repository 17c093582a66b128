"""Incremental detokenization never emits a broken UTF-8 character, by either path: a byte-level BPE
tokenizer's per-token bytes through an incremental UTF-8 decoder, or decoding windows of tokens."""
import random

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.token_bytes import token_byte_table
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module", params=["byte-table", "windows"])
def tok(smollm2_dir, request):
    tokenizer = Tokenizer(smollm2_dir)
    if request.param == "windows":
        tokenizer._token_bytes = None
    else:
        assert tokenizer.token_bytes is not None  # SmolLM2's tokenizer is byte-level BPE
    return tokenizer


def stream(tok, prompt, ids, stop=()):
    d = IncrementalDetokenizer(tok, prompt, list(stop))
    deltas = []
    for t in ids:
        hit = d.add_token(t)
        deltas.append(d.take_delta(False))
        if hit:
            break
    else:
        d.flush()
    deltas.append(d.take_delta(True))
    return deltas, d.text


def test_multibyte_characters_are_held_until_complete(tok):
    text = "Prices: 5€, café, 日本語, emoji 😀🚀 done."
    ids = tok.encode(text)
    # At least one character must be split over several byte-level tokens.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    deltas, final = stream(tok, tok.encode("Say:"), ids)
    assert "".join(deltas) == text == final
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_split_across_tokens_is_never_emitted(tok):
    text = "alpha beta gamma delta"
    deltas, final = stream(tok, [1], tok.encode(text), stop=["gamma d"])
    assert final == "alpha beta "
    assert "".join(deltas) == final
    assert all("g" not in d for d in deltas)


def test_streamed_text_is_the_decode_of_random_tokens(tok):
    """Random ids make invalid and unfinished UTF-8 too: the streamed text is what decode gives at the end."""
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas, final = stream(tok, [1, 2, 3], ids)
        assert "".join(deltas) == final == tok.decode(ids)


def test_the_byte_table_is_refused_for_a_tokenizer_that_is_not_byte_level():
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models
    backend = RustTokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.Metaspace()
    assert token_byte_table(backend, 3) is None
