"""Per-expert token counts exported (worker_runtime/moe_metrics.py), engine-level, no worker process.

A real engine runs the tiny Qwen3-MoE checkpoint (2 sparse layers of 8 experts, top-2; a dense layer
between them); the worker's collector then exports `pdserve:moe_expert_tokens_total{expert}` equal to
transformers' routing of the same tokens summed over the sparse layers, and `pdserve:moe_layer_imbalance
{layer}` equal to max / mean of that routing per layer, for the tokens of the last reading only. A dense
model exports neither. (tests/cluster/test_model_families_cluster.py reads the same series from worker
processes.)
"""
from __future__ import annotations

import re

import pytest
import torch
from prometheus_client import generate_latest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.test_moe_models import hf_expert_counts, tiny_moe
from worker_runtime.metrics import WorkerMetrics
from worker_runtime.moe_metrics import MoeRoutingReader

PROMPTS = [[3 + (131 * i) % 49000 for i in range(40)], [11, 400, 9000, 77] * 6 + [5]]
MAX_TOKENS = 6


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class StatsLoop:
    """The engine loop as WorkerMetrics sees it: a stats snapshot."""

    def __init__(self) -> None:
        self.stats: dict = {}
        self.observe_transfer_s = None


def series(text: str, name: str, label: str) -> dict[int, float]:
    """{label value: sample} of one family in Prometheus text."""
    pattern = re.compile(rf'^{re.escape(name)}\{{[^}}]*{label}="(\d+)"[^}}]*\}} (\S+)$')
    return {int(m.group(1)): float(m.group(2)) for m in map(pattern.match, text.splitlines()) if m}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer_dir):
    return tiny_moe("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), tokenizer_dir)


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.completions[0].token_ids for o in engine.generate(prompts, params)]


def scrape(metrics: WorkerMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_expert_tokens_and_imbalance_equal_transformers_routing(moe_dir):
    engine = LLMEngine(EngineConfig(model=str(moe_dir), dtype="float32",
                                    cache=CacheConfig(num_blocks=64, enable_prefix_caching=False)))
    clock, loop = Clock(), StatsLoop()
    reader = MoeRoutingReader(engine.runner.model, interval_s=5.0, clock=clock)
    metrics = WorkerMetrics(loop, "decode", "w:1")

    # 1. Two requests; every token the engine ran (prompt, then fed-back outputs) is counted.
    outputs = greedy(engine, PROMPTS)
    want = hf_expert_counts(moe_dir, [p + o[:-1] for p, o in zip(PROMPTS, outputs, strict=True)])
    assert sorted(want) == [0, 2]
    loop.stats = {"moe": reader.read()}
    text = scrape(metrics)
    tokens = series(text, "pdserve:moe_expert_tokens_total", "expert")
    assert tokens == {e: float(want[0][e] + want[2][e]) for e in range(8)}
    tokens_in = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    assert sum(tokens.values()) == tokens_in * 2 * 2  # top-2, two sparse layers
    assert 'role="decode",worker="w:1"' in text
    imbalance = series(text, "pdserve:moe_layer_imbalance", "layer")
    expected = {i: want[i].max().item() * 8 / want[i].sum().item() for i in (0, 2)}
    assert imbalance == pytest.approx(expected)
    assert all(v > 1.0 for v in imbalance.values())  # random routing is never perfectly even

    # 2. A third request: within the interval the snapshot stands; after it, the counter has grown by the
    #    new tokens' routing and the imbalance is that of the new tokens alone.
    third = [[42, 43, 44] * 5]
    out3 = greedy(engine, third)
    assert reader.read() is loop.stats["moe"]  # not re-read yet (no device copy per engine step)
    clock.now += 5.0
    loop.stats = {"moe": reader.read()}
    text = scrape(metrics)
    new = hf_expert_counts(moe_dir, [third[0] + out3[0][:-1]])
    grown = series(text, "pdserve:moe_expert_tokens_total", "expert")
    assert grown == {e: tokens[e] + new[0][e].item() + new[2][e].item() for e in range(8)}
    assert series(text, "pdserve:moe_layer_imbalance", "layer") == pytest.approx(
        {i: new[i].max().item() * 8 / new[i].sum().item() for i in (0, 2)})
    assert not engine.has_unfinished() and engine.kv.pool.num_used_blocks == 0


def test_a_dense_model_exports_no_moe_series(tiny_qwen2_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", cache=CacheConfig(num_blocks=16)))
    reader = MoeRoutingReader(engine.runner.model)
    assert reader.read() is None
    loop = StatsLoop()
    loop.stats = {"moe": reader.read(), "num_running": 0}
    text = scrape(WorkerMetrics(loop, "prefill", "w:2"))
    assert "pdserve:num_requests_running" in text and "moe_" not in text


def test_reader_copies_the_counts_it_reports():
    """A later engine step must not change a snapshot already handed to the scrape."""
    counts = {0: torch.tensor([3, 1]), 1: torch.tensor([0, 4])}

    class Model:
        def expert_token_counts(self):
            return {i: c.clone() for i, c in counts.items()}

    clock = Clock()
    reader = MoeRoutingReader(Model(), interval_s=1.0, clock=clock)
    first = reader.read()
    assert first == {"experts": [3, 5], "imbalance": {0: 1.5, 1: 2.0}}
    counts[0] += torch.tensor([2, 2])  # layer 0 even this time; layer 1 saw nothing: keeps its last value
    clock.now += 1.0
    second = reader.read()
    assert first == {"experts": [3, 5], "imbalance": {0: 1.5, 1: 2.0}}
    assert second == {"experts": [5, 7], "imbalance": {0: 1.0, 1: 2.0}}
