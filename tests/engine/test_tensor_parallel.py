"""Tensor parallelism (engine/parallel/): the weight slices, then whole engines against one rank.

The sharding tests need no processes. The engine tests start real rank processes (gloo on CPU) and
compare greedy tokens with a one-rank engine (float32): plain requests, chunked prefill, preemption,
and 3 ranks on SmolLM2 (9 heads, 3 KV heads).
"""
import argparse
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.parallel.layers import vocab_parallel_embedding
from engine.parallel.sharding import shard_cols, shard_merged, shard_rows, shard_vocab, vocab_range
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# ---- the slices ------------------------------------------------------------
class SumOfRanks:
    """Stands in for the group of a rank computed in this process: collects each rank's tensor, and
    `total` is what all_reduce would hand back."""

    def __init__(self) -> None:
        self.parts = []

    def all_reduce(self, x):
        self.parts.append(x.clone())
        return x

    @property
    def total(self):
        return torch.stack(self.parts).sum(0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_qkv_and_gate_up_shards_reassemble(world):
    torch.manual_seed(0)
    head_dim, hidden, heads, kv_heads = 4, 12, 6, 3
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    shards = [shard_merged([q, k, v], r, world) for r in range(world)]
    q_rows, kv_rows = heads * head_dim // world, kv_heads * head_dim // world
    for r, shard in enumerate(shards):  # rank r: its q heads, then its k heads, then its v heads
        assert shard.shape == (q_rows + 2 * kv_rows, hidden)
        assert torch.equal(shard[:q_rows], q[r * q_rows:(r + 1) * q_rows])
    parts = [s.split([q_rows, kv_rows, kv_rows]) for s in shards]
    for i, whole in enumerate((q, k, v)):
        assert torch.equal(torch.cat([p[i] for p in parts]), whole)
    gate, up = torch.randn(12, hidden), torch.randn(12, hidden)
    halves = [shard_merged([gate, up], r, world).chunk(2) for r in range(world)]
    assert torch.equal(torch.cat([h[0] for h in halves]), gate)
    assert torch.equal(torch.cat([h[1] for h in halves]), up)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_linears_equal_the_full_one(world):
    torch.manual_seed(1)
    x = torch.randn(5, 12, dtype=torch.float64)
    w_col, bias = torch.randn(18, 12, dtype=torch.float64), torch.randn(18, dtype=torch.float64)
    # column-parallel: each rank's outputs are a slice of the full output; concatenated, the whole
    col = [F.linear(x, shard_rows(w_col, r, world), shard_rows(bias, r, world)) for r in range(world)]
    assert torch.allclose(torch.cat(col, dim=-1), F.linear(x, w_col, bias))
    # row-parallel: each rank multiplies its slice of the inputs; the sum is the full product
    w_row = torch.randn(7, 12, dtype=torch.float64)
    row = [F.linear(shard_cols(x, r, world), shard_cols(w_row, r, world)) for r in range(world)]
    assert torch.allclose(torch.stack(row).sum(0), F.linear(x, w_row))
    assert torch.equal(torch.cat([shard_cols(w_row, r, world) for r in range(world)], dim=1), w_row)
    with pytest.raises(ValueError, match="do not split"):
        shard_rows(torch.zeros(10, 2), 0, 3)


@pytest.mark.parametrize("vocab,world", [(12, 2), (10, 3), (7, 4)])
def test_vocab_shards_embed_and_project_like_the_whole(vocab, world):
    torch.manual_seed(2)
    weight = torch.randn(vocab, 6)
    shards = [shard_vocab(weight, r, world) for r in range(world)]
    assert len({s.shape[0] for s in shards}) == 1  # one size: padded where V % N
    ranges = [vocab_range(vocab, r, world) for r in range(world)]
    assert torch.equal(torch.cat([s[:e - b] for s, (b, e) in zip(shards, ranges, strict=True)]), weight)
    ids = torch.tensor([0, vocab - 1, 3 % vocab, 5 % vocab, 0])
    group = SumOfRanks()
    for r in range(world):
        vocab_parallel_embedding(ids, shards[r], ranges[r][0], group)
    assert torch.equal(group.total, F.embedding(ids, weight))  # each row from exactly one rank
    h = torch.randn(3, 6)
    logits = torch.cat([F.linear(h, s) for s in shards], dim=-1)[:, :vocab]  # what the gathered head returns
    assert torch.allclose(logits, F.linear(h, weight))


# ---- engines ---------------------------------------------------------------
def tiny_prompts():
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 120))] for _ in range(7)]
    return prompts + [prompts[0][:40] + [9] * 30, [7]]


def generate(model_dir, prompts, tp, params=GREEDY, pp=1, partition=None, **overrides):
    """Every completion's tokens (n of them per prompt), from an engine with `tp` ranks (in each of `pp`
    pipeline stages of `partition`'s layers)."""
    config = EngineConfig(model=str(model_dir), dtype="float32", tensor_parallel_size=tp,
                          pipeline_parallel_size=pp, pp_layer_partition=partition,
                          scheduler=overrides.pop("scheduler", SchedulerConfig()),
                          cache=overrides.pop("cache", CacheConfig(num_blocks=512)))
    engine = LLMEngine(config)
    try:
        tokens = [[c.token_ids for c in o.completions] for o in engine.generate(prompts, params)]
        assert not engine.has_unfinished() and engine.kv.pool.num_used_blocks == 0
        return engine, tokens
    finally:
        engine.shutdown()


VARIANTS = {
    "plain": {"cache": CacheConfig(num_blocks=512, enable_prefix_caching=False)},
    "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=32)},  # prompts span several steps
    "preempt": {"cache": CacheConfig(num_blocks=14, enable_prefix_caching=False)},  # 224 tokens for 9 requests
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_equal_one_on_tiny_qwen2(tiny_qwen2_dir, variant):
    prompts = tiny_prompts()
    # Two prompts fork into 3 samples after their prompt: copy-on-write of the shared partial block,
    # which every rank must apply to its own cache.
    forks = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3)
    params = [GREEDY] * (len(prompts) - 2) + [forks] * 2
    one, expected = generate(tiny_qwen2_dir, prompts, 1, params, **dict(VARIANTS[variant]))
    two, got = generate(tiny_qwen2_dir, prompts, 2, params, **dict(VARIANTS[variant]))
    assert [len(c) for c in got] == [1] * (len(prompts) - 2) + [3, 3]
    assert two.runner.model.config.num_kv_heads == 1 and two.runner.kv_cache.shape[4] == 1  # its KV heads only
    assert two.runner.model.embed.shape[0] == 49152 // 2
    if variant == "preempt":
        assert two.scheduler.num_preemptions > 0 and one.scheduler.num_preemptions > 0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} differs"


def test_three_ranks_equal_one_on_smollm2(smollm2_dir):
    from engine.tokenizer import Tokenizer
    tokenizer = Tokenizer(smollm2_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three colours.", "Why is the sky blue?")]
    prompts.append(tokenizer.encode("The history of computing spans centuries, from the abacus to"))
    _, expected = generate(smollm2_dir, prompts, 1)
    three, got = generate(smollm2_dir, prompts, 3)
    assert three.runner.model.config.num_heads == 3 and three.runner.kv_cache.shape[4] == 1
    assert got == expected


@pytest.mark.parametrize("how", ["killed", "fails_mid_step"])
def test_a_dead_rank_is_an_error_not_a_hang(tiny_qwen2_dir, how):
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", tensor_parallel_size=2,
                                    cache=CacheConfig(num_blocks=64)))
    try:
        assert engine.generate([[5, 6, 7]], GREEDY)[0].completions[0].token_ids
        if how == "killed":  # between steps: found before the next step is sent
            engine.executor.procs[1].kill()
            engine.executor.procs[1].join()
            match = "rank 1 exited"
        else:  # rank 1 raises on a step it cannot run: found before the next step, or when its collectives break
            engine.executor.conns[1].send_bytes(pickle.dumps(("step", "not a step")))
            match = "(?s)rank 1 exited .*TypeError: ModelRunner.run_step"  # its traceback
        with pytest.raises(RuntimeError, match=match):
            engine.generate([[5, 6, 7, 8] * 10], GREEDY)
    finally:
        engine.shutdown()


def test_tp_size_must_divide_the_head_counts(tiny_qwen2_dir):
    with pytest.raises(ValueError, match="4 attention heads and 2 KV heads"):
        LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_cli_flag_reaches_the_engine_config():
    from pdserve.cli import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--tensor-parallel-size", "2"])).tensor_parallel_size == 2
    assert engine_config_from_args(parser.parse_args([])).tensor_parallel_size == 1


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_shards_give_the_quantized_logits(tiny_qwen2_dir, quantization):
    """Each rank quantizes its own shard (a row-parallel shard gets its own per-channel scales), so the
    logits are not bit-equal to one rank's quantized ones: they differ from them less than quantization
    moves them, and stay as close to the unquantized logits. Also runs `forward_prompt` (scoring) across
    the ranks."""
    prompt = torch.tensor(tiny_prompts()[1][:48])
    rows = torch.arange(prompt.shape[0])
    logits = {}
    for tp, quant in ((1, None), (1, quantization), (2, quantization)):
        engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", tensor_parallel_size=tp,
                                        quantization=quant, cache=CacheConfig(num_blocks=8)))
        try:
            logits[tp, quant] = engine.runner.forward_prompt(prompt, rows).float()
        finally:
            engine.shutdown()
    exact, one, two = logits[1, None], logits[1, quantization], logits[2, quantization]
    assert not torch.equal(one, exact)  # quantization did something
    assert (two - one).abs().max() <= (one - exact).abs().max()
    # as close to the unquantized logits as one rank's (measured: int8 0.027 vs 0.028, fp8 0.101 vs 0.106)
    assert (two - exact).abs().mean() <= 1.2 * (one - exact).abs().mean()


def test_fp8_checkpoint_shards_equal_one_rank(tiny_qwen2_dir, tmp_path):
    """An fp8 checkpoint's weights and scales are sliced as stored: every rank dequantizes exactly its
    part of one rank's weights, so the logits agree up to summation order."""
    from engine.model.fp8_checkpoint import save_fp8_checkpoint
    path = save_fp8_checkpoint(tiny_qwen2_dir, tmp_path / "fp8")
    prompt = torch.tensor(tiny_prompts()[2][:40])
    logits = []
    for tp in (1, 2):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=tp,
                                        cache=CacheConfig(num_blocks=8)))
        try:
            logits.append(engine.runner.forward_prompt(prompt, torch.arange(prompt.shape[0])).float())
        finally:
            engine.shutdown()
    assert torch.allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4 * float(logits[0].abs().max()))


def test_ranks_exit_when_the_engine_process_dies(tiny_qwen2_dir, tmp_path):
    script = tmp_path / "engine_dies.py"
    script.write_text(f"""
import os, signal
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
if __name__ == "__main__":
    engine = LLMEngine(EngineConfig(model={str(tiny_qwen2_dir)!r}, dtype="float32", tensor_parallel_size=2,
                                    cache=CacheConfig(num_blocks=8)))
    print(engine.executor.procs[1].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind
""")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=root,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _running(pid):
        assert time.monotonic() < deadline, f"rank 1 (pid {pid}) outlived the engine process"
        time.sleep(0.2)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
