"""The load tester's arithmetic: percentiles, per-request metrics, SLOs, goodput, arrivals, datasets."""
from __future__ import annotations

import math
import statistics

import pytest

from loadtest.arrivals import arrival_offsets
from loadtest.config import DatasetConfig, LoadTestConfig, parse_slos
from loadtest.datasets import load_prompts
from loadtest.stats import RequestRecord, describe, meets_slos, percentile, summarize
from loadtest.sweep import goodput_rate


def record(index=0, ttft=0.1, gaps=(0.02, 0.03), status="OK", prompt_len=10) -> RequestRecord:
    r = RequestRecord(index=index, prompt_len=prompt_len, send_time=100.0, status=status)
    if status == "OK":
        t = 100.0 + ttft
        r.chunk_times = [t]
        for g in gaps:
            t += g
            r.chunk_times.append(t)
        r.output_tokens = len(r.chunk_times)
        r.end_time = t + 0.001
    else:
        r.end_time = 100.5
    return r


def test_percentile_interpolates_like_numpy():
    xs = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(xs, 50) == 35.0
    assert percentile(xs, 0) == 15.0 and percentile(xs, 100) == 50.0
    assert percentile(xs, 40) == pytest.approx(29.0)  # numpy.percentile(xs, 40) == 29.0
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([], 50) == 0.0


def test_describe_mean_std_and_keys():
    out = describe([1.0, 2.0, 3.0, 4.0], "ttft")
    assert out["mean_ttft_ms"] == 2.5
    assert out["median_ttft_ms"] == 2.5
    assert out["std_ttft_ms"] == pytest.approx(statistics.pstdev([1, 2, 3, 4]))
    assert set(out) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p90_ttft_ms",
                        "p99_ttft_ms"}


def test_request_metrics_follow_the_vllm_definitions():
    r = record(ttft=0.1, gaps=(0.02, 0.03, 0.05))
    assert r.ttft == pytest.approx(0.1)
    assert r.itls == pytest.approx([0.02, 0.03, 0.05])
    assert r.e2el == pytest.approx(0.201)
    assert r.tpot == pytest.approx((0.201 - 0.1) / 3)
    one = record(gaps=())
    assert one.tpot is None  # undefined for a single output token


def test_summary_counts_failures_pools_itl_and_names_fields_as_vllm():
    records = [record(0, 0.1, (0.02,)), record(1, 0.3, (0.04, 0.06)), record(2, status="RESOURCE_EXHAUSTED"),
               record(3, status="RESOURCE_EXHAUSTED"), record(4, status="DEADLINE_EXCEEDED")]
    s = summarize(records, duration=2.0, slos_ms={})
    assert s["completed"] == 2 and s["failed"] == 3
    assert s["failures_by_status"] == {"RESOURCE_EXHAUSTED": 2, "DEADLINE_EXCEEDED": 1}
    assert s["total_output_tokens"] == 5 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 2.5
    assert s["total_token_throughput"] == 12.5
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_itl_ms"] == pytest.approx((20 + 40 + 60) / 3)  # pooled over requests, not per request
    for key in ("duration", "median_ttft_ms", "p99_itl_ms", "p90_tpot_ms", "std_e2el_ms"):
        assert key in s
    assert "request_goodput" not in s  # only with SLOs


def test_slo_attainment_and_goodput():
    fast, slow_ttft, slow_tpot = record(0, 0.1, (0.02,)), record(1, 0.5, (0.02,)), record(2, 0.1, (0.2,))
    failed = record(3, status="UNAVAILABLE")
    slos = parse_slos(["ttft:200", "tpot:50"])
    assert slos == {"ttft": 200.0, "tpot": 50.0}
    assert meets_slos(fast, slos) and not meets_slos(slow_ttft, slos) and not meets_slos(slow_tpot, slos)
    assert not meets_slos(failed, slos)
    s = summarize([fast, slow_ttft, slow_tpot, failed], duration=4.0, slos_ms=slos)
    assert s["good_requests"] == 1
    assert s["slo_attainment"] == 0.25  # failed requests count as missing the SLO
    assert s["request_goodput"] == 0.25


def test_goodput_rate_is_the_highest_rate_meeting_the_target():
    runs = [{"request_rate": 1.0, "slo_attainment": 1.0}, {"request_rate": 2.0, "slo_attainment": 0.95},
            {"request_rate": 4.0, "slo_attainment": 0.5}]
    assert goodput_rate(runs) == 2.0
    assert goodput_rate([{"request_rate": 1.0, "slo_attainment": 0.89}]) is None


def test_poisson_and_gamma_arrivals_have_the_asked_mean_and_burstiness():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    for burstiness in (1.0, 0.25, 4.0):
        t = arrival_offsets(20001, rate=50.0, burstiness=burstiness, seed=1)
        gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
        assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
        # gamma(k, theta): coefficient of variation 1/sqrt(k)
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    assert arrival_offsets(10, 5.0, seed=3) == arrival_offsets(10, 5.0, seed=3)


def test_random_and_prefix_datasets_have_exact_lengths_and_shared_prefixes():
    cfg = DatasetConfig(name="random", random_input_len=100, random_output_len=20, random_range_ratio=0.5)
    prompts = load_prompts(cfg, 50, seed=0)
    assert all(50 <= p.prompt_len == len(p.token_ids) <= 150 and 10 <= p.output_len <= 30 for p in prompts)
    assert len({tuple(p.token_ids) for p in prompts}) == 50
    assert len({p.prompt_len for p in prompts}) > 1
    fixed = load_prompts(DatasetConfig(name="random", random_input_len=64, random_output_len=8), 5, seed=0)
    assert {(p.prompt_len, p.output_len) for p in fixed} == {(64, 8)}

    cfg = DatasetConfig(name="prefix", prefix_num_prefixes=3, prefix_len=40, suffix_len=8, prefix_output_len=5)
    prompts = load_prompts(cfg, 12, seed=0)
    assert all(p.prompt_len == 48 and p.output_len == 5 for p in prompts)
    prefixes = {tuple(p.token_ids[:40]) for p in prompts}
    assert len(prefixes) == 3
    assert len({tuple(p.token_ids[40:]) for p in prompts}) == 12


def test_sharegpt_dataset_uses_first_turns_and_the_reply_length(tmp_path, smollm2_dir):
    from engine.tokenizer import Tokenizer
    data = [{"conversations": [{"from": "human", "value": f"Tell me a long story about the number {i}."},
                               {"from": "gpt", "value": "Once upon a time there was a number. " * (i + 1)}]}
            for i in range(3)]
    data.append({"conversations": [{"from": "human", "value": "hi"}]})  # no reply: skipped
    path = tmp_path / "sg.json"
    path.write_text(__import__("json").dumps(data))
    prompts = load_prompts(DatasetConfig.from_spec(f"sharegpt:{path}"), 3, seed=0)
    tok = Tokenizer(smollm2_dir)
    replies = {d["conversations"][0]["value"]: d["conversations"][1]["value"] for d in data[:3]}
    assert sorted(p.text for p in prompts) == sorted(replies)
    for p in prompts:
        assert p.token_ids is None and p.prompt_len == len(tok.encode(p.text))
        assert p.output_len == len(tok.encode(replies[p.text]))


def test_configs_refuse_bad_values():
    with pytest.raises(ValueError, match="sharegpt:FILE"):
        DatasetConfig.from_spec("sharegpt")
    with pytest.raises(ValueError, match="dataset"):
        DatasetConfig.from_spec("nope")
    with pytest.raises(ValueError, match="request_rate"):
        LoadTestConfig(url="h:1", request_rate=0)
    with pytest.raises(ValueError, match="unknown SLO"):
        LoadTestConfig(url="h:1", slos={"itl_p99": 1.0})
    with pytest.raises(ValueError, match="METRIC:MS"):
        parse_slos(["ttft200"])
    with pytest.raises(ValueError, match="HOST:PORT"):
        LoadTestConfig(url="localhost")
