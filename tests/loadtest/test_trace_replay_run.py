"""Trace replay end to end against the fake Generation server (its usage reports prefix-cache hits)."""
from __future__ import annotations

import json

import pytest

from loadtest.config import DatasetConfig, LoadTestConfig
from loadtest.fake_server import FakeServerThread
from loadtest.runner import run
from pdserve.cli import main as pdserve_main


@pytest.fixture
def fake():
    server = FakeServerThread(0.02, 0.005)
    yield server
    server.stop()


def write_trace(tmp_path, rows) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def conversations(num_sessions: int, turns: int, timestamp=lambda s, t: 0) -> list[dict]:
    """num_sessions chats of `turns` turns, each turn's hash ids its previous turn's plus two blocks, all
    behind the shared system prompt block 0; rows in turn-major order (every first turn, then every second...)."""
    rows = []
    for t in range(turns):
        for s in range(num_sessions):
            ids = [0] + [1000 * (s + 1) + k for k in range(2 * t + 2)]
            rows.append({"timestamp": timestamp(s, t), "input_length": 512 * len(ids), "output_length": 96,
                         "hash_ids": ids})
    return rows


def trace_config(url: str, path: str, **kwargs) -> LoadTestConfig:
    return LoadTestConfig(url=url, dataset=DatasetConfig.from_spec(f"mooncake:{path}"), progress=False, **kwargs)


def assert_turns_wait_for_the_previous_turn(records) -> None:
    by_session: dict[str, list] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.send_time >= prev.end_time, (prev.to_json(), nxt.to_json())


def test_fixed_schedule_sends_at_scaled_timestamps_and_turns_wait_for_their_answer(fake, tmp_path):
    # Every turn at timestamp 0 except session 0's turns at 0, 1, 2 s: only the dependency holds turns back.
    rows = conversations(3, 3, timestamp=lambda s, t: 1000 * t if s == 0 else 0)
    rows.sort(key=lambda r: r["timestamp"])
    result = run(trace_config(fake.address, write_trace(tmp_path, rows), num_prompts=100, trace_time_scale=0.05))
    records = result.records
    assert len(records) == 9 and all(r.ok for r in records)
    assert sorted(r.offset_s for r in records) == pytest.approx([0.0] * 7 + [0.05, 0.1])  # 1 s, 2 s times 0.05
    assert all(r.send_time >= r.scheduled_time for r in records)
    assert_turns_wait_for_the_previous_turn(records)
    assert result.summary["trace_schedule"] == "fixed" and result.summary["num_sessions"] == 3


def test_order_mode_keeps_concurrency_trace_order_and_turn_dependencies(fake, tmp_path):
    rows = sorted(conversations(6, 3), key=lambda r: r["hash_ids"][1])  # session-major: a chat's turns back to back
    result = run(trace_config(fake.address, write_trace(tmp_path, rows), num_prompts=18, max_concurrency=3))
    records = result.records
    assert len(records) == 18 and all(r.ok for r in records)
    assert fake.servicer.max_in_flight == 3
    assert_turns_wait_for_the_previous_turn(records)
    first_turns = sorted((r for r in records if r.turn == 0), key=lambda r: r.index)
    sends = [r.send_time for r in first_turns]
    assert sends == sorted(sends)  # the first turns (no dependency) go out in trace order
    s = result.summary
    assert s["trace_schedule"] == "order" and s["trace_slice"] == {"first_requests": 18}
    assert set(s["per_turn"]) == {"0", "1", "2"} and all(t["completed"] == 6 for t in s["per_turn"].values())
    # the fake server's prefix memory reuses what an ideal cache would: the two measures agree
    assert s["prefix_hit_ratio"] == pytest.approx(s["ideal_prefix_hit_ratio"]) and s["prefix_hit_ratio"] > 0.3


def test_cli_trace_run_writes_hit_ratios_per_turn_and_per_request_fields(fake, tmp_path, capsys):
    path = write_trace(tmp_path, conversations(4, 4))
    out, detail = tmp_path / "result.json", tmp_path / "requests.jsonl"
    code = pdserve_main(["loadtest", "--url", fake.address, "--dataset", f"mooncake:{path}", "--trace-sessions", "2",
                         "--max-concurrency", "2", "--trace-max-output-len", "2", "--output", str(out),
                         "--save-requests", str(detail), "--no-progress"])
    assert code == 0
    table = capsys.readouterr().out
    assert "Prefix hit ratio (%):" in table and "Ideal prefix hit ratio (%):" in table
    assert "By turn of a session" in table and "3+" in table
    data = json.loads(out.read_text())
    assert data["trace_slice"] == {"sessions": 2, "min_turns": 1}
    assert data["num_prompts"] == 8 and data["num_sessions"] == 2
    assert data["completed"] == 8 and data["dataset_name"] == "mooncake"
    assert data["prefix_hit_ratio"] == pytest.approx(data["ideal_prefix_hit_ratio"])
    assert list(data["per_turn"]) == ["0", "1", "2", "3+"]
    assert data["per_turn"]["0"]["prefix_hit_ratio"] < data["per_turn"]["3+"]["prefix_hit_ratio"]
    for key in ("mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p50_itl_ms", "p99_itl_ms"):
        assert data["per_turn"]["1"][key] > 0
    lines = [json.loads(line) for line in detail.read_text().splitlines()]
    assert sorted((x["session_id"], x["turn"]) for x in lines) == [(f"line-{s}", t) for s in (1, 2) for t in range(4)]
    assert all(x["output_len"] == 2 for x in lines)
    assert sum(x["cached_tokens"] for x in lines) == data["total_cached_tokens"] > 0


def test_random_runs_report_the_hit_ratio_too(fake):
    dataset = DatasetConfig(name="prefix", prefix_num_prefixes=1, prefix_len=64, suffix_len=16, prefix_output_len=2)
    s = run(LoadTestConfig(url=fake.address, dataset=dataset, num_prompts=5, max_concurrency=1,
                           progress=False)).summary
    assert s["prefix_hit_ratio"] == pytest.approx(4 * 64 / (5 * 80))  # every prompt but the first reuses the prefix
    assert "ideal_prefix_hit_ratio" not in s and "per_turn" not in s


def test_sweep_of_a_trace_is_refused(tmp_path):
    path = write_trace(tmp_path, conversations(1, 1))
    assert pdserve_main(["loadtest", "--url", "h:1", "--dataset", f"mooncake:{path}", "--sweep", "1,2",
                         "--goodput", "ttft:100"]) == 2
