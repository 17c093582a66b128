"""Incremental detokenization never emits a broken UTF-8 character."""
import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return Tokenizer(smollm2_dir)


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
