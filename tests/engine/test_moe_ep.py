"""Expert parallelism (engine/parallel/expert_parallel.py, `--enable-expert-parallel`).

Without processes: the placement and its expert map, the weight cut, and the per-rank experts half (torch
loop and the Triton fused MoE under TRITON_INTERPRET=1) whose parts, summed as the all-reduce sums them,
equal the one-rank layer, while each rank's weights of the other experts are never read (NaN there leaves
the result finite). Then whole engines with two real rank processes (gloo): Qwen3-MoE and Mixtral with
EP=2 give transformers' greedy tokens (fp32) and the one-rank engine's, each rank holding 4 of the 8
experts whole, with the per-expert counts of all experts on rank 0. Refusals name the flag.
"""
import argparse
import os
import shutil

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.model_config import ModelConfig
from engine.model.moe import MoeSpec, MoeWeights, experts_forward, route
from engine.parallel.expert_parallel import (
    ExpertPlacement,
    check_expert_parallel,
    local_experts_forward,
    shard_expert_weights,
)
from engine.parallel.sharding import check_tp_size
from tests.engine import test_moe_models
from tests.engine.test_hf_equivalence import GREEDY
from tests.engine.test_moe_models import CHUNK, SPARSE_LAYERS, assert_equal, small_qwen3_moe

moe_case = test_moe_models.moe_case  # the tiny Qwen3-MoE and Mixtral checkpoints and transformers' tokens

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="the triton wheel is part of the test install")

from engine.model.moe_triton import align_block_size, fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, EXPERTS = 24, 16, 8


def random_layer(top_k: int, gpt_oss: bool, seed: int = 0) -> tuple[MoeSpec, MoeWeights]:
    """A layer of random weights; `gpt_oss`: its scoring, clamped SwiGLU and expert biases."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.5

    spec = (MoeSpec(EXPERTS, top_k, "topk_softmax", swiglu_limit=1.5) if gpt_oss
            else MoeSpec(EXPERTS, top_k, renormalize=top_k != 3))
    biases = (rand(EXPERTS), rand(EXPERTS, 2 * INTER), rand(EXPERTS, HIDDEN)) if gpt_oss else (None, None, None)
    return spec, MoeWeights(rand(EXPERTS, HIDDEN), rand(EXPERTS, 2 * INTER, HIDDEN), rand(EXPERTS, HIDDEN, INTER),
                            *biases)


def test_placement_gives_contiguous_whole_experts_and_vllm_expert_map():
    ranks = [ExpertPlacement(8, r, 4) for r in range(4)]
    assert [(p.start, p.end, p.num_local) for p in ranks] == [(0, 2, 2), (2, 4, 2), (4, 6, 2), (6, 8, 2)]
    assert ranks[1].expert_map().tolist() == [-1, -1, 0, 1, -1, -1, -1, -1]
    assert ranks[1].expert_map().dtype == torch.int32
    with pytest.raises(ValueError, match=r"enable_expert_parallel: 3 ranks must divide the model's 8 experts"):
        ExpertPlacement(8, 0, 3)


def test_weights_are_cut_to_whole_experts_router_kept():
    _, w = random_layer(2, gpt_oss=True)
    mine = shard_expert_weights(w, ExpertPlacement(EXPERTS, 1, 2))
    assert torch.equal(mine.router, w.router) and torch.equal(mine.router_bias, w.router_bias)
    for got, whole in ((mine.w13, w.w13), (mine.w2, w.w2), (mine.b13, w.b13), (mine.b2, w.b2)):
        assert torch.equal(got, whole[4:8])


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("top_k,world", [(2, 2), (3, 4)])
@pytest.mark.parametrize("num_tokens", [0, 1, 9, 60])
def test_ranks_parts_sum_to_the_whole_layer(num_tokens, top_k, world, gpt_oss):
    spec, w = random_layer(top_k, gpt_oss)
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    topk_weights, ids = route(hidden, w, spec)
    whole = experts_forward(hidden, w, spec, topk_weights, ids)
    parts = []
    for rank in range(world):
        placement = ExpertPlacement(EXPERTS, rank, world)
        out = local_experts_forward(hidden, shard_expert_weights(w, placement), spec, topk_weights, ids, placement)
        assert out.expert_counts.tolist() == whole.expert_counts.tolist()  # all E, on every rank
        # Tokens none of whose experts live here get exact zeros.
        here = ((ids >= placement.start) & (ids < placement.end)).any(dim=1)
        assert (out.hidden[~here] == 0).all()
        parts.append(out.hidden)
    torch.testing.assert_close(torch.stack(parts).sum(0), whole.hidden, rtol=1e-6, atol=1e-6)


def test_other_ranks_experts_are_never_read():
    """NaN in the experts of the other rank, still in this rank's tensors, leave this rank's part finite."""
    spec, w = random_layer(2, gpt_oss=False)
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(7))
    topk_weights, ids = route(hidden, w, spec)
    placement = ExpertPlacement(EXPERTS, 0, 2)
    mine = shard_expert_weights(w, placement)
    want = local_experts_forward(hidden, mine, spec, topk_weights, ids, placement)
    # The Triton kernel indexes the local tensors by the map: poison rows past the local ones would be out
    # of range there, so give it 8 experts whose upper four (another rank's, mapped to -1) are NaN.
    poisoned = MoeWeights(w.router, w.w13.clone(), w.w2.clone())
    poisoned.w13[4:], poisoned.w2[4:] = float("nan"), float("nan")
    got = fused_moe(hidden.to(DEVICE), MoeWeights(*(t.to(DEVICE) for t in (poisoned.router, poisoned.w13,
                                                                             poisoned.w2))),
                    spec, topk_weights.to(DEVICE), ids.to(DEVICE), placement.expert_map(DEVICE))
    assert torch.isfinite(got.hidden).all()
    torch.testing.assert_close(got.hidden.cpu(), want.hidden, rtol=1e-5, atol=1e-5)


def test_align_block_size_maps_blocks_to_local_experts():
    ids = torch.tensor([[2, 0], [2, 5], [0, 2], [5, 1]])
    placement = ExpertPlacement(6, 1, 2)  # experts 3, 4, 5 here: local 0, 1, 2
    _, whole, _ = align_block_size(ids, 6, block_m=4)
    _, mapped, counts = align_block_size(ids, 6, 4, placement.expert_map())
    assert counts.tolist() == [2, 1, 3, 0, 0, 2]
    assert whole[whole >= 0].tolist() == [0, 1, 2, 5]
    assert mapped[:4].tolist() == [-1, -1, -1, 2]  # expert 5 is local 2; the others' blocks are -1
    assert (mapped[4:] == -1).all()


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])  # 40 x 2 pairs: 64-row blocks
def test_triton_fused_moe_honours_the_expert_map(num_tokens, gpt_oss):
    spec, w = random_layer(2, gpt_oss)
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    topk_weights, ids = route(hidden, w, spec)
    whole = experts_forward(hidden, w, spec, topk_weights, ids)
    parts = []
    for rank in range(2):
        placement = ExpertPlacement(EXPERTS, rank, 2)
        mine = shard_expert_weights(w, placement)
        on = MoeWeights(*(t.to(DEVICE) if t is not None else None
                          for t in (mine.router, mine.w13, mine.w2, mine.router_bias, mine.b13, mine.b2)))
        out = fused_moe(hidden.to(DEVICE), on, spec, topk_weights.to(DEVICE), ids.to(DEVICE),
                        placement.expert_map(DEVICE))
        want = local_experts_forward(hidden, mine, spec, topk_weights, ids, placement)
        torch.testing.assert_close(out.hidden.cpu(), want.hidden, rtol=1e-5, atol=1e-5)
        assert out.expert_counts.tolist() == whole.expert_counts.tolist()
        parts.append(out.hidden.cpu())
    torch.testing.assert_close(parts[0] + parts[1], whole.hidden, rtol=1e-5, atol=1e-5)


# ---- whole engines ----------------------------------------------------------------------------------
def generate(path, prompts, tp: int, expert_parallel: bool) -> tuple[LLMEngine, list[list[int]]]:
    """Greedy tokens of an engine with `tp` ranks (chunked prefill), checked for leaks, then shut down."""
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=tp,
                                    enable_expert_parallel=expert_parallel, cache=CacheConfig(num_blocks=512),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK)))
    try:
        tokens = [o.completions[0].token_ids for o in engine.generate(prompts, GREEDY)]
        assert not engine.has_unfinished() and engine.kv.pool.num_used_blocks == 0
        return engine, tokens
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def one_rank(moe_case):
    """The one-rank engine's greedy tokens and per-expert counts on the same prompts (chunked alike)."""
    family, path, prompts, expected = moe_case
    engine, tokens = generate(path, prompts, 1, expert_parallel=False)
    return tokens, engine.runner.model.expert_token_counts()


def test_two_expert_parallel_ranks_equal_transformers_and_one_rank(moe_case, one_rank):
    family, path, prompts, expected = moe_case
    engine, tokens = generate(path, prompts, 2, expert_parallel=True)
    assert_equal(tokens, expected)
    assert_equal(tokens, one_rank[0])
    model = engine.runner.model
    assert model.config.moe.intermediate_size == 40  # whole experts, not a slice of each
    sparse = model.layers[SPARSE_LAYERS[family][0]].moe
    assert (sparse.placement.start, sparse.placement.end) == (0, 4)  # rank 0 holds experts 0..3
    gate_up, down = sparse.weights.linears[0]  # CPU: each expert's prepacked linears (moe.pack_experts)
    assert len(sparse.weights.linears) == 4
    assert (gate_up.out_features, gate_up.in_features, down.out_features, down.in_features) == (80, 72, 72, 40)
    assert sparse.expert_map.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    # Rank 0 routes every token: its counts cover all 8 experts, as the one-rank engine's.
    counts = model.expert_token_counts()
    assert sorted(counts) == SPARSE_LAYERS[family]
    for i, c in counts.items():
        assert c.tolist() == one_rank[1][i].tolist(), f"layer {i}"
        assert c[4:].sum() > 0  # the other rank's experts were chosen too: the exchange was exercised


def ep_config(path, tp: int = 2) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=tp, enable_expert_parallel=True)


def test_expert_parallel_needs_several_ranks():
    with pytest.raises(ValueError, match=r"enable_expert_parallel needs tensor_parallel_size > 1"):
        EngineConfig(enable_expert_parallel=True)


def test_expert_parallel_is_refused_for_a_dense_model(tiny_qwen2_dir):
    with pytest.raises(ValueError, match=r"enable_expert_parallel needs a Mixture-of-Experts model; "
                                         r"Qwen2ForCausalLM has no experts"):
        LLMEngine(ep_config(tiny_qwen2_dir))


def test_experts_the_ranks_do_not_split_are_refused(tmp_path, tokenizer_dir):
    (tmp_path / "config.json").write_text(small_qwen3_moe(num_experts=6, num_attention_heads=4,
                                                          num_key_value_heads=4).to_json_string())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    config = ModelConfig.from_dir(tmp_path)
    check_expert_parallel(2, config)
    with pytest.raises(ValueError, match=r"enable_expert_parallel: 4 ranks must divide the model's 6 experts"):
        check_expert_parallel(4, config)
    with pytest.raises(ValueError, match=r"enable_expert_parallel: 4 ranks must divide the model's 6 experts"):
        LLMEngine(ep_config(tmp_path, tp=4))  # refused before any rank process starts


def test_expert_width_need_not_split_with_expert_parallel(tmp_path):
    (tmp_path / "config.json").write_text(small_qwen3_moe(moe_intermediate_size=9).to_json_string())
    config = ModelConfig.from_dir(tmp_path)
    check_tp_size(2, config, expert_parallel=True)  # each expert stays whole
    with pytest.raises(ValueError, match=r"must divide the experts' intermediate size 9"):
        check_tp_size(2, config)


def test_cli_flag_reaches_the_engine_config():
    from pdserve.cli import add_engine_args, engine_config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    config = engine_config_from_args(args)
    assert config.enable_expert_parallel and config.tensor_parallel_size == 2
    assert not engine_config_from_args(p.parse_args([])).enable_expert_parallel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel in bf16 needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 33, 300])
def test_triton_expert_parallel_parts_in_bf16_on_cuda(num_tokens):
    spec, w = random_layer(2, gpt_oss=False)
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    topk_weights, ids = route(hidden, w, spec)
    whole = experts_forward(hidden, w, spec, topk_weights, ids).hidden
    total = torch.zeros_like(whole)
    for rank in range(2):
        placement = ExpertPlacement(EXPERTS, rank, 2)
        mine = shard_expert_weights(w, placement)
        on = MoeWeights(*(t.to("cuda", torch.bfloat16) for t in (mine.router, mine.w13, mine.w2)))
        out = fused_moe(hidden.to("cuda", torch.bfloat16), on, spec, topk_weights.cuda(), ids.cuda(),
                        placement.expert_map("cuda"))
        total += out.hidden.float().cpu()
    torch.testing.assert_close(total, whole, rtol=2e-2, atol=2e-2)
