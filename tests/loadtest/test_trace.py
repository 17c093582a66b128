"""Mooncake trace replay without network: token mapping, sessions, slices, offsets, hit ratios, bad input, flags."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from loadtest.cli import add_arguments, config_from_args
from loadtest.config import DatasetConfig, LoadTestConfig
from loadtest.datasets import Prompt, load_prompts
from loadtest.prefix import ideal_prefix_hit_ratio
from loadtest.stats import RequestRecord, per_turn, summarize, turn_bucket
from loadtest.trace import TraceRequest, hash_block_tokens, read_trace, select, trace_offsets, with_sessions


def write_trace(tmp_path, rows, name="trace.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def row(hash_ids, input_length, output_length=64, timestamp=0, **extra) -> dict:
    return {"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
            "hash_ids": hash_ids, **extra}


def mooncake(path, **kwargs) -> DatasetConfig:
    return DatasetConfig.from_spec(f"mooncake:{path}", **kwargs)


def test_hash_ids_map_to_the_same_tokens_everywhere_and_lengths_scale(tmp_path):
    path = write_trace(tmp_path, [row([1, 2, 3], 1536, 512), row([1, 2, 4], 1300, 0), row([5], 100, 70),
                                  row([6], 1024), row([6], 1024)])
    prompts = load_prompts(mooncake(path, vocab_size=1000), 100, seed=7)
    block = {h: hash_block_tokens(h, 16, 1000, seed=7) for h in range(1, 7)}
    a, b, c, d, e = (p.token_ids for p in prompts)
    assert a == block[1] + block[2] + block[3]  # 1536 * 16 / 512 = 48: exactly its three blocks
    assert b == block[1] + block[2] + block[4][:9]  # round(1300 / 32) = 41: the shared prefix, then cut
    assert c == block[5][:3]  # round(100 / 32) = 3
    assert d[:16] == e[:16] == block[6] and d[16:] != e[16:] and len(d) == len(e) == 32  # padding is per request
    assert [p.prompt_len for p in prompts] == [48, 41, 3, 32, 32]
    assert all(100 <= t < 1000 for p in prompts for t in p.token_ids)
    assert [p.output_len for p in prompts] == [16, 1, 2, 2, 2]  # max(1, round(len * 16 / 512))
    assert load_prompts(mooncake(path, vocab_size=1000), 100, seed=7)[1].token_ids == b  # same run to run
    assert load_prompts(mooncake(path, vocab_size=1000), 100, seed=8)[1].token_ids != b  # the seed matters
    other = load_prompts(mooncake(path, trace_block_tokens=8, trace_output_scale=0.5, trace_max_output_len=100), 9, 0)
    assert [p.prompt_len for p in other] == [24, 20, 2, 16, 16]  # N = 8: lengths * 8 / 512
    assert [p.output_len for p in other] == [100, 1, 35, 32, 32]  # 512 * 0.5 capped at 100


def test_hash_block_tokens_do_not_depend_on_the_process():
    code = "from loadtest.trace import hash_block_tokens; print(hash_block_tokens(123456, 16, 49152, 3))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert json.loads(out.stdout) == hash_block_tokens(123456, 16, 49152, 3)


CONVERSATIONS = [
    row([0, 1, 2], 1300),           # 1: session line-1 (complete blocks [0, 1])
    row([0, 5, 6], 1300),           # 2: only the system prompt id 0 in common with 1: a new session
    row([0, 1, 7, 8], 2000),        # 3: starts with 1's complete blocks: line-1, turn 1
    row([0, 1, 7, 9, 10], 2400),    # 4: starts with 3's [0, 1, 7] (longer than 1's): line-1, turn 2
    row([0, 5, 6, 11], 2000),       # 5: line-2, turn 1
    row([0], 512),                  # 6: one complete block: too short to be continued
    row([0, 12], 800),              # 7: shares [0] with 6 and everyone: a new session
    row([3, 1, 2], 1536),           # 8: the same ids as 1 but not at the same positions: new
]


def test_sessions_are_inferred_from_complete_block_prefixes_not_the_shared_first_block(tmp_path):
    requests = with_sessions(read_trace(write_trace(tmp_path, CONVERSATIONS)))
    assert [(r.session_id, r.turn) for r in requests] == [
        ("line-1", 0), ("line-2", 0), ("line-1", 1), ("line-1", 2), ("line-2", 1), ("line-6", 0), ("line-7", 0),
        ("line-8", 0)]
    assert [r.line for r in requests] == list(range(1, 9))


def test_given_session_ids_are_used_as_they_are(tmp_path):
    rows = [row([0, 1, 2], 1536, session_id="a"), row([0, 1, 2, 3], 2048, session_id="b"),
            row([9], 100, session_id="a")]
    requests = with_sessions(read_trace(write_trace(tmp_path, rows)))
    assert [(r.session_id, r.turn) for r in requests] == [("a", 0), ("b", 0), ("a", 1)]
    with pytest.raises(ValueError, match=r"trace.jsonl:2: no session_id"):
        read_trace(write_trace(tmp_path, [rows[0], row([1], 10), rows[2]]))


def test_slice_is_the_first_requests_or_every_turn_of_the_first_sessions(tmp_path):
    requests = with_sessions(read_trace(write_trace(tmp_path, CONVERSATIONS)))
    assert [r.line for r in select(requests, 3)] == [1, 2, 3]
    assert [r.line for r in select(requests, 100, num_sessions=2)] == [1, 2, 3, 4, 5]
    assert [r.line for r in select(requests, 1, num_sessions=3)] == [1, 2, 3, 4, 5, 6]
    # conversations only: line-1 (3 turns) and line-2 (2); the one-request sessions are skipped
    assert [r.line for r in select(requests, 1, num_sessions=3, min_turns=2)] == [1, 2, 3, 4, 5]
    assert [r.line for r in select(requests, 1, num_sessions=1, min_turns=3)] == [1, 3, 4]
    with pytest.raises(ValueError, match="give trace_sessions"):
        mooncake(write_trace(tmp_path, CONVERSATIONS), trace_min_turns=2)
    prompts = load_prompts(mooncake(write_trace(tmp_path, CONVERSATIONS), trace_sessions=2), 1, 0)
    assert [(p.session_id, p.turn) for p in prompts] == [("line-1", 0), ("line-2", 0), ("line-1", 1),
                                                          ("line-1", 2), ("line-2", 1)]


def test_fixed_schedule_offsets_are_the_timestamps_from_the_first_scaled():
    prompts = [Prompt(1, 1, arrival_ms=t) for t in (1000.0, 1500.0, 4000.0)]
    assert trace_offsets(prompts, 0.5) == pytest.approx([0.0, 0.25, 1.5])
    assert trace_offsets(prompts) == pytest.approx([0.0, 0.5, 3.0])


def test_ideal_prefix_hit_ratio_by_hand():
    a, b, c, d = ([i] * 4 for i in (101, 102, 103, 104))
    prompts = [a + b + [1, 2],   # 10 tokens, nothing seen
               a + b + c,        # 12 tokens: a, b seen -> 8
               d + b,            # 8 tokens: b after d is another block chain -> 0
               a + [5, 6, 7]]    # 7 tokens: a -> 4
    assert ideal_prefix_hit_ratio(prompts, block_size=4) == pytest.approx(12 / 37)
    assert ideal_prefix_hit_ratio([a + b] * 2, block_size=16) == 0.0  # no full 16-token block
    assert ideal_prefix_hit_ratio([list(range(40))] * 3) == pytest.approx(2 * 32 / 120)
    assert ideal_prefix_hit_ratio([]) == 0.0


def record(turn, ttft, cached=0, prompt_len=10, status="OK") -> RequestRecord:
    r = RequestRecord(index=0, prompt_len=prompt_len, send_time=0.0, status=status, cached_tokens=cached, turn=turn)
    if status == "OK":
        r.chunk_times, r.end_time, r.output_tokens = [ttft, ttft + 0.01], ttft + 0.01, 2
    return r


def test_prefix_hit_ratio_and_per_turn_buckets():
    assert [turn_bucket(t) for t in (None, 0, 1, 2, 3, 7)] == ["0", "0", "1", "2", "3+", "3+"]
    records = [record(0, 0.1), record(None, 0.3), record(1, 0.2, cached=5), record(3, 0.4, cached=10),
               record(5, 0.6, cached=8), record(2, 0.5, cached=9, status="UNAVAILABLE")]
    s = summarize(records, 1.0, {})
    assert s["prefix_hit_ratio"] == pytest.approx(23 / 50) and s["total_cached_tokens"] == 23  # failed left out
    turns = per_turn(records)
    assert list(turns) == ["0", "1", "2", "3+"]
    assert turns["0"]["completed"] == 2 and turns["0"]["mean_ttft_ms"] == pytest.approx(200.0)
    assert turns["3+"]["requests"] == 2 and turns["3+"]["p50_ttft_ms"] == pytest.approx(500.0)
    assert turns["3+"]["prefix_hit_ratio"] == pytest.approx(18 / 20)
    assert turns["2"]["completed"] == 0 and turns["2"]["mean_ttft_ms"] == 0.0
    assert turns["1"]["mean_itl_ms"] == pytest.approx(10.0)


@pytest.mark.parametrize(("lines", "message"), [
    ([row([1], 10), "{not json", row([2], 10)], r"trace.jsonl:2: not valid JSON"),
    ([row([1], 10), row([2], 10), {"timestamp": 0, "input_length": 5, "output_length": 1}],
     r"trace.jsonl:3: missing field\(s\) hash_ids"),
    ([row([1], 10), "[1, 2]"], r"trace.jsonl:2: expected a JSON object"),
    ([row("12", 10)], r"trace.jsonl:1: hash_ids must be a list of integers"),
    ([row([1], -3)], r"trace.jsonl:1: input_length must be an integer >= 0"),
    ([row([1], 10, timestamp=50), row([1], 10, timestamp=40)], r"trace.jsonl:2: timestamps must not decrease"),
    (["", "  "], r"trace.jsonl: empty trace"),
])
def test_bad_traces_are_refused_naming_the_line(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        read_trace(write_trace(tmp_path, lines))


def test_blank_lines_are_skipped_but_counted(tmp_path):
    requests = read_trace(write_trace(tmp_path, [row([1], 10), "", row([2], 20)]))
    assert [(r.line, r.hash_ids) for r in requests] == [(1, (1,)), (3, (2,))]
    assert isinstance(requests[0], TraceRequest)


def parse(argv: list[str]):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(["--url", "h:1", *argv]))


def test_trace_flags_map_onto_the_config(tmp_path):
    path = write_trace(tmp_path, CONVERSATIONS)
    config = parse(["--dataset", f"mooncake:{path}", "--trace-block-tokens", "8", "--trace-source-block-tokens",
                    "256", "--trace-output-scale", "0.1", "--trace-max-output-len", "12", "--trace-sessions", "3",
                    "--trace-schedule", "fixed", "--trace-time-scale", "0.25"])
    d = config.dataset
    assert (d.name, d.path, d.trace_block_tokens, d.trace_source_block_tokens) == ("mooncake", path, 8, 256)
    assert (d.trace_output_scale, d.trace_max_output_len, d.trace_sessions) == (0.1, 12, 3)
    assert (config.trace_schedule, config.trace_time_scale) == ("fixed", 0.25)
    assert parse(["--dataset", f"mooncake:{path}", "--max-concurrency", "4"]).trace_schedule == "order"
    assert parse(["--dataset", f"mooncake:{path}"]).trace_schedule == "fixed"
    assert parse([]).trace_schedule is None  # not a trace


@pytest.mark.parametrize(("argv", "message"), [
    (["--trace-schedule", "order"], "give --max-concurrency"),
    (["--request-rate", "5"], "--request-rate and --rate-schedule do not apply"),
    (["--num-warmups", "2"], "no warm-up"),
    (["--trace-time-scale", "0"], "trace_time_scale must be"),
    (["--trace-sessions", "0"], "trace_sessions must be >= 1"),
    (["--trace-block-tokens", "0"], "trace_block_tokens must be >= 1"),
])
def test_trace_flags_are_validated(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        parse(["--dataset", f"mooncake:{write_trace(tmp_path, CONVERSATIONS)}", *argv])


def test_trace_only_flags_are_refused_elsewhere():
    with pytest.raises(ValueError, match="mooncake:FILE"):
        parse(["--trace-schedule", "fixed"])
    with pytest.raises(ValueError, match="mooncake:FILE"):
        parse(["--trace-sessions", "2"])
    with pytest.raises(ValueError, match="needs a file"):
        DatasetConfig.from_spec("mooncake")
    assert LoadTestConfig(url="h:1").dataset.is_trace is False
