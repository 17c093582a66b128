"""The Triton fused elementwise ops (engine/model/fused_triton.py) against the unfused torch ops they replace,
under TRITON_INTERPRET=1 on CPU (compiled on a GPU host): residual add + RMSNorm in place, RMSNorm (Llama's and
Gemma's), SiLU * up, GELU(tanh) * up, and RoPE in place with and without writing K and V into their cache
slots. float32 to 1e-5; bfloat16 to what one rounding of the output allows."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="the triton wheel is part of the test install")

from engine.model.fused_triton import TritonFusedOps  # noqa: E402
from engine.model.llama import rms_norm  # noqa: E402
from engine.model.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
OPS = TritonFusedOps()


def rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("hidden", [576, 64])  # SmolLM2's (not a power of two) and a small one
def test_add_rms_norm_and_rms_norm_equal_the_unfused_ops(dtype, hidden):
    x, residual, weight = rand(5, hidden, dtype=dtype), rand(5, hidden, dtype=dtype, seed=1), \
        rand(hidden, dtype=dtype, seed=2)
    want_residual = residual + x
    want = rms_norm(want_residual, weight, 1e-6)
    got_x, got_residual = x.clone(), residual.clone()
    assert OPS.add_rms_norm_(got_x, got_residual, weight, 1e-6) is got_x
    torch.testing.assert_close(got_residual, want_residual, **TOL[dtype])
    torch.testing.assert_close(got_x, want, **TOL[dtype])
    torch.testing.assert_close(OPS.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), **TOL[dtype])
    assert OPS.rms_norm(x[:0], weight, 1e-6).shape == (0, hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_silu_and_mul_equals_the_unfused_ops(dtype):
    gate_up = rand(7, 2 * 1536, dtype=dtype)  # SmolLM2's intermediate size: two column blocks of 1024
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(OPS.silu_and_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gemma_norm_and_gelu_and_mul_equal_the_unfused_ops(dtype):
    """Gemma's RMSNorm (float32 throughout, (1 + w) a float32 weight, one rounding) and GELU(tanh) * up, the
    GELU rounded before the product as F.gelu's output is."""
    from engine.model.gemma import gemma_rms_norm
    x, weight = rand(5, 576, dtype=dtype), 1.0 + rand(576, dtype=torch.float32, seed=2)
    torch.testing.assert_close(OPS.rms_norm(x, weight, 1e-6), gemma_rms_norm(x, weight, 1e-6), **TOL[dtype])
    gate_up = 3 * rand(7, 2 * 1536, dtype=dtype, seed=3)  # gates far out on both tails of the tanh
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(OPS.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up, **TOL[dtype])
    assert OPS.gelu_tanh_and_mul(gate_up[:0]).shape == (0, 1536)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("write_kv", [False, True, "flat"], ids=["rope", "rope+kv-write", "rope+kv-write-flat"])
def test_rope_in_place_and_the_cache_write_equal_the_unfused_ops(dtype, write_kv):
    """Slots as (block, offset) pairs (the torch backend's) or flat with -1 for a padding token (the Triton
    backend's slot mapping, as a CUDA graph pads it): each real token's K and V land in its slot, nothing else
    is written."""
    tokens, hq, hkv, d, block_size = 6, 4, 2, 64, 4
    rotary = RotaryEmbedding(d, 256, 10000.0, None, dtype=dtype, device=torch.device(DEVICE))
    positions = torch.tensor([0, 3, 17, 100, 101, 255], device=DEVICE)
    qkv = rand(tokens, (hq + 2 * hkv) * d, dtype=dtype)
    cos, sin = rotary.lookup(positions)
    qk = qkv[:, :(hq + hkv) * d].view(tokens, hq + hkv, d)
    want_qk = RotaryEmbedding.apply(qk, cos, sin)
    got = qkv.clone()
    kv_cache = torch.zeros((5, 1, 2, block_size, hkv, d), dtype=dtype, device=DEVICE)  # [blocks, layers, 2, ...]
    k_cache, v_cache = kv_cache[:, 0, 0], kv_cache[:, 0, 1]  # strided views, as the model passes them
    slots = torch.tensor([0, 5, 6, 13, 18, -1 if write_kv == "flat" else 19], device=DEVICE)  # -1: padding
    blocks, offsets = slots // block_size, slots % block_size
    if write_kv == "flat":
        OPS.rope_(got, positions, rotary.cos, rotary.sin, hq, hkv, k_cache, v_cache, slot_mapping=slots)
    elif write_kv:
        OPS.rope_(got, positions, rotary.cos, rotary.sin, hq, hkv, k_cache, v_cache, blocks, offsets)
    else:
        OPS.rope_(got, positions, rotary.cos, rotary.sin, hq, hkv)
    torch.testing.assert_close(got[:, :(hq + hkv) * d].view(tokens, hq + hkv, d), want_qk, **TOL[dtype])
    assert torch.equal(got[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:])  # v untouched
    if write_kv:
        real = slots >= 0
        blocks, offsets = blocks[real], offsets[real]
        torch.testing.assert_close(k_cache[blocks, offsets], want_qk[real, hq:], **TOL[dtype])
        assert torch.equal(v_cache[blocks, offsets], qkv[real, (hq + hkv) * d:].view(-1, hkv, d))
        others = torch.ones(5 * block_size, dtype=torch.bool, device=DEVICE)
        others[slots[real]] = False
        flat = kv_cache[:, 0].transpose(0, 1).reshape(2, 5 * block_size, hkv, d)  # [k or v, slot, ...]
        assert not flat[:, others].any()  # no other slot written
    else:
        assert not kv_cache.any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_model_on_the_triton_ops_generates_what_the_unfused_model_does(tiny_qwen2_dir, backend):
    """The decoder's fused forward with these kernels (RoPE writing K/V into the paged cache's strided views,
    add + norm in place): greedy tokens equal the unfused ops' on a tiny Qwen2 (float32). With the Triton
    attention backend RoPE writes K/V by its flat slot mapping and the backend's KV-write kernel is skipped."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    prompts = [[(7 * i + j) % 400 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = []
    for ops in (None, OPS):
        engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", cache=CacheConfig(num_blocks=64),
                                        attention_backend=backend))
        engine.runner.model.fused = ops
        if backend == "triton" and ops is not None:  # the backend's own KV write must not run
            kernels = engine.runner.model.attention._kernels
            engine.runner.model.attention._kernels = WithoutKVWrite(kernels)
        try:
            tokens.append([o.completions[0].token_ids for o in engine.generate(prompts, params)])
        finally:
            engine.shutdown()
    assert tokens[0] == tokens[1]


class WithoutKVWrite:
    """The Triton attention kernels, but the KV write refused: RoPE must have written K/V."""

    def __init__(self, kernels) -> None:
        self.paged_attention = kernels.paged_attention

    def write_kv(self, *args, **kwargs):
        raise AssertionError("the backend wrote K/V that RoPE had written")
