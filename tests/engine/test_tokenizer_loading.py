"""The tokenizer class AutoTokenizer chose is remembered: later processes load the same tokenizer without
importing torch (most of a router's start), and anything unexpected in the record falls back to AutoTokenizer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "naïve café ☕ 日本語", "<|im_start|>user"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]

LOAD_SCRIPT = """
import json, sys
from engine.tokenizer import Tokenizer
tokenizer = Tokenizer(__import__("pathlib").Path(sys.argv[1]))
texts, chat = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps({"torch": "torch" in sys.modules, "class": type(tokenizer.hf_tokenizer).__name__,
                  "encodings": [tokenizer.encode(t) for t in texts], "chat": tokenizer.apply_chat_template(chat),
                  "decoded": tokenizer.decode(tokenizer.encode(texts[2]))}))
"""


def load_in_fresh_process(model_dir: Path, cache: Path) -> dict:
    env = {**os.environ, "PDSERVE_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(model_dir), json.dumps(TEXTS), json.dumps(CHAT)],
                         env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_second_process_loads_the_same_tokenizer_without_torch(smollm2_dir, tmp_path):
    first = load_in_fresh_process(smollm2_dir, tmp_path)
    assert first["torch"], "the first load goes through AutoTokenizer (which imports torch via the config)"
    assert list(json.loads((tmp_path / "tokenizer-classes.json").read_text()).values()) == [first["class"]]
    second = load_in_fresh_process(smollm2_dir, tmp_path)
    assert not second["torch"]
    assert second == {**first, "torch": False}
    assert second["decoded"] == TEXTS[2]


def test_a_record_naming_no_class_or_a_corrupt_file_falls_back_to_autotokenizer(smollm2_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    import engine.tokenizer_loading as loading

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    reference = AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    key = loading._choice_key(smollm2_dir, __import__("transformers").__version__)
    for record in (json.dumps({key: "NoSuchTokenizerClass"}), "{not json", json.dumps(["a list"])):
        loading.choices_file().write_text(record)
        tokenizer = loading.load_hf_tokenizer(smollm2_dir)
        assert type(tokenizer) is type(reference)
        assert [tokenizer.encode(t) for t in TEXTS] == [reference.encode(t) for t in TEXTS]
        assert json.loads(loading.choices_file().read_text())[key] == type(reference).__name__


def test_changed_tokenizer_files_are_a_new_key(smollm2_dir, tmp_path):
    import shutil

    import engine.tokenizer_loading as loading

    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, copy / name)
    before = loading._choice_key(copy, "5.0")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    assert loading._choice_key(copy, "5.0") != before
    assert loading._choice_key(copy, "5.1") != loading._choice_key(copy, "5.0")
