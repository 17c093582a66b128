"""`pdserve generate --offline`: input validation with line numbers and fields, output format."""
import json
import subprocess
import sys

import pytest

from common.jsonl_requests import LineError, parse_line

GOOD = {"id": "ok", "prompt": "Hello", "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("line, field", [
    ("{not json", "<json>"),
    ("[1, 2]", "<json>"),
    (json.dumps({"prompt": "x", "token_ids": [1]}), "prompt"),
    (json.dumps({"id": "x"}), "prompt"),
    (json.dumps({"prompt": "x", "temprature": 0.5}), "temprature"),
    (json.dumps({"prompt": "x", "max_tokens": "5"}), "max_tokens"),
    (json.dumps({"prompt": "x", "ignore_eos": 1}), "ignore_eos"),
    (json.dumps({"prompt": "x", "temperature": -0.1}), "temperature"),
    (json.dumps({"prompt": "x", "top_p": 1.5}), "top_p"),
    (json.dumps({"token_ids": [1, "a"]}), "token_ids"),
    (json.dumps({"token_ids": [1, True]}), "token_ids"),
    (json.dumps({"messages": [{"role": "user"}]}), "messages[0]"),
    (json.dumps({"prompt": ""}), "prompt"),
    (json.dumps({"prompt": "x", "id": 5}), "id"),
    (json.dumps({"prompt": "x", "stop": ["a"] * 17}), "stop"),
    (json.dumps({"prompt": "x", "regex": "a", "choice": ["b"]}), "choice"),
    (json.dumps({"prompt": "x", "json_schema": "{oops"}), "structured_output.json_schema"),
    (json.dumps({"prompt": "x", "logit_bias": {"one": 1}}), "logit_bias"),
    (json.dumps({"prompt": "x", "min_p": 2}), "min_p"),
])
def test_bad_lines_name_line_and_field(line, field):
    with pytest.raises(LineError) as e:
        parse_line(7, line)
    assert e.value.line_no == 7 and e.value.field == field
    assert str(e.value).startswith(f"line 7: field {field!r}")


def test_good_line_maps_fields_onto_sampling_params():
    r = parse_line(1, json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 3,
                                  "stop": "x", "top_k": -1, "logprobs": 2}))
    assert r.request_id == "a" and r.messages and r.params.n == 2 and r.params.stop == ["x"]
    assert r.params.top_k == 0 and r.params.logprobs == 2 and r.params.seed == 3
    assert parse_line(4, json.dumps({"prompt": "p"})).request_id == "4"
    r = parse_line(5, json.dumps({"prompt": "p", "json_schema": {"type": "object"}, "logit_bias": {"7": -1.5},
                                  "bad_words": ["no"], "repetition_penalty": 1.1, "prompt_logprobs": 2}))
    assert r.params.structured_output.kind == "json_schema" and r.params.logit_bias == {7: -1.5}
    assert r.params.bad_words == ["no"] and r.params.repetition_penalty == 1.1 and r.params.prompt_logprobs == 2
    assert parse_line(6, json.dumps({"prompt": "p", "choice": ["a", "b"]})).params.structured_output.value == ("a", "b")


def test_cli_reports_bad_lines_and_still_runs_good_ones(tmp_path):
    lines = [
        json.dumps(GOOD),
        json.dumps({"id": "bad-temp", "prompt": "x", "temperature": -1}),
        json.dumps({"id": "bad-token", "token_ids": [1, 10**9]}),
        "",
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "temperature": 0, "max_tokens": 20, "n": 2, "logprobs": 1}),
        json.dumps({"id": "ok", "prompt": "dup"}),
        json.dumps({"id": "too-long", "token_ids": [5] * 9000}),
        json.dumps({"id": "constrained", "prompt": "Is Paris in France?", "choice": ["yes", "no"], "temperature": 0,
                    "prompt_logprobs": 1}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--offline", "--model", "default",
                           "--input", str(src), "--output", str(dst)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "line 2: field 'temperature'" in proc.stderr
    assert "line 3: field 'token_ids'" in proc.stderr and "outside the vocabulary" in proc.stderr
    assert "line 6: field 'id'" in proc.stderr and "duplicate" in proc.stderr
    assert "line 7: field 'input'" in proc.stderr
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [(r["id"], r.get("index")) for r in rows] == [("ok", None), ("chat", 0), ("chat", 1), ("constrained", None)]
    constrained = rows.pop()
    assert constrained["text"] in ("yes", "no") and constrained["finish_reason"] == "stop"
    assert len(constrained["prompt_logprobs"]) == constrained["usage"]["prompt_tokens"] - 1
    assert len(rows[0]["token_ids"]) == 3 and rows[0]["finish_reason"] == "length"
    for r in rows[1:]:
        assert r["text"] == "The capital of France is Paris." and r["finish_reason"] == "stop"
        assert r["usage"]["prompt_tokens"] == 37 and len(r["logprobs"]) == len(r["token_ids"])
        assert set(r) == {"id", "index", "token_ids", "text", "finish_reason", "usage", "logprobs"}


def test_cli_kv_cache_dtype_fp8_reaches_the_engine(tmp_path, caplog):
    """In-process `pdserve.cli.main` (the test above runs the real subprocess)."""
    from pdserve.cli import main
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                               "temperature": 0, "max_tokens": 8}) + "\n")
    caplog.set_level("INFO", logger="engine")
    assert main(["--log-level", "info", "generate", "--offline", "--model", "default", "--kv-cache-dtype", "fp8",
                 "--kv-cache-memory-gib", "0.05", "--input", str(src), "--output", str(dst)]) == 0
    assert "float8_e4m3fn" in caplog.text  # the KV cache's log line
    assert json.loads(dst.read_text())["text"] == "The capital of France is Paris."
