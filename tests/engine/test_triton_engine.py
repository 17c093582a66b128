"""The whole engine through the Triton backend gives the torch backend's greedy tokens.

On CPU the kernels run under Triton's interpreter (slow, so the fixture is the
tiny random Qwen2 and few tokens); on a GPU host they are compiled. Covers
plain batches, chunked prefill with cached context, preemption, prefix-cache
hits, overlapped steps (as on CUDA), and `pdserve generate --offline --attention-backend triton`.
"""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton wheel is part of the test install")

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    base = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 9, 40, 75)]
    return base + [base[3][:48] + [11, 12, 13]]  # shares three full blocks with the one before


def generate(model_dir, backend, prompts, **overrides):
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device=DEVICE, attention_backend=backend,
                                    overlap_steps=overrides.pop("overlap_steps", None),
                                    scheduler=overrides.pop("scheduler", SchedulerConfig()),
                                    cache=overrides.pop("cache", CacheConfig(kv_cache_memory_bytes=16 << 20)),
                                    speculative=overrides.pop("speculative", SpeculativeConfig())))
    outputs = engine.generate(prompts, GREEDY)
    assert engine.kv.pool.num_used_blocks == 0 and not engine.has_unfinished()
    return engine, [o.completions[0].token_ids for o in outputs], outputs


@pytest.fixture(scope="module")
def expected(tiny_qwen2_dir, prompts):
    return generate(tiny_qwen2_dir, "torch", prompts)[1]


@pytest.mark.parametrize("variant", ["plain", "chunked", "preempt", "overlap", "speculative"])
def test_triton_backend_equals_torch_backend(tiny_qwen2_dir, prompts, expected, variant):
    kwargs = {"plain": {},
              # the model as its own draft: every proposal accepted, K + 1 rows of logits per sequence
              "speculative": {"speculative": SpeculativeConfig(method="draft", model=str(tiny_qwen2_dir),
                                                               num_speculative_tokens=3)},
              "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=24)},
              "preempt": {"cache": CacheConfig(num_blocks=9, enable_prefix_caching=False)},
              "overlap": {"overlap_steps": True, "scheduler": SchedulerConfig(max_num_batched_tokens=24)}}[variant]
    engine, got, outputs = generate(tiny_qwen2_dir, "triton", prompts, **kwargs)
    assert engine.runner.varlen is not None  # the varlen inputs and the Triton kernels ran
    if variant == "plain":  # again on the same engine: now full blocks come from the prefix cache
        again = engine.generate(prompts, GREEDY)
        assert [o.num_cached_tokens for o in again] == [0, 0, 32, 64, 48]
        assert [o.completions[0].token_ids for o in again] == expected
    if variant == "preempt":
        assert engine.scheduler.num_preemptions > 0
    if variant == "speculative":
        assert engine.num_spec_accepted_tokens == engine.num_spec_draft_tokens > 0
    assert got == expected


def test_offline_cli_with_triton_backend(tmp_path, tiny_qwen2_dir, prompts, expected):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "token_ids": p, "temperature": 0, "ignore_eos": True,
                                       "max_tokens": NEW_TOKENS}) + "\n" for i, p in enumerate(prompts)))
    dst = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--offline", "--model", str(tiny_qwen2_dir),
                    "--dtype", "float32", "--device", DEVICE, "--attention-backend", "triton",
                    "--kv-cache-memory-gib", "0.02", "--input", str(src), "--output", str(dst)],
                   check=True, timeout=300)
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == expected
