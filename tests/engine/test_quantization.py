"""Weight quantization: int8 weight-only and fp8 at load, and fp8 checkpoints (written and loaded).

The model-level checks score the same text position by position (teacher-forced) with the
unquantized float32 model and a quantized one: the top-1 next token must agree at most positions
and the linears' weights must shrink. A broken scale, a transposed weight or a wrong merge of
q/k/v drops the agreement to near zero.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.model.fp8_checkpoint import save_fp8_checkpoint
from engine.model.linear import Linear
from engine.model.loader import read_tensors, resolve_quantization
from engine.model.model_config import ModelConfig
from engine.model.quantization import FP8_DTYPE, checkpoint_scales, dequantize, quantize_fp8, quantize_int8
from engine.model.quantized_linear import Int8Linear, make_fp8_linear
from engine.model_runner import ModelRunner

POSITIONS = 256


def test_int8_round_trip_is_within_half_a_step_per_row():
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different magnitude
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (64,) and int(q.abs().max()) == 127
    assert torch.all((dequantize(q, s, torch.float32) - w).abs() <= s[:, None] / 2 + 1e-7)


def test_fp8_round_trip_has_e4m3_precision_per_row_and_per_tensor():
    w = torch.randn(64, 96) * torch.logspace(-2, 1, 64)[:, None]
    for per_channel in (True, False):
        q, s = quantize_fp8(w, per_channel=per_channel)
        assert q.dtype == FP8_DTYPE and s.shape == ((64,) if per_channel else ())
        back = q.float() * (s[:, None] if per_channel else s)
        # 3 mantissa bits: relative error <= 2^-4 for normal values; subnormals of a per-tensor scale add
        # an absolute floor of half their spacing (2^-10 of the scale)
        assert torch.all((back - w).abs() <= w.abs() / 16 + 2.0**-10 * (s.max() if per_channel else s))


def test_checkpoint_scales_take_one_per_tensor_or_one_per_row():
    assert torch.equal(checkpoint_scales(torch.tensor(0.5), 3), torch.full((3,), 0.5))
    assert torch.equal(checkpoint_scales(torch.tensor([[1.0], [2.0]]), 2), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="3 values for a weight of 2 rows"):
        checkpoint_scales(torch.ones(3), 2)


@pytest.mark.parametrize("kernel", [True, False])
def test_int8_linear_equals_the_dequantized_weight(kernel):
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 64), torch.randn(48), torch.randn(5, 64)
    q, s = quantize_int8(w)
    linear = Int8Linear(q, s, b, torch.float32)
    assert linear.kernel == kernel or kernel is False, "torch._weight_int8pack_mm runs on every CPU torch ships"
    linear.kernel = kernel
    want = torch.nn.functional.linear(x, dequantize(q, s, torch.float32), b)
    # bf16 activations and scales on CPU: ~3 significant digits
    torch.testing.assert_close(linear(x), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert linear.nbytes == 48 * 64 + 48 * 2


def test_fp8_on_cpu_falls_back_to_the_dequantized_weight():
    w = torch.randn(32, 64)
    q, s = quantize_fp8(w)
    linear = make_fp8_linear(q, s, None, torch.float32)
    assert isinstance(linear, Linear) and linear.weight_dtype == torch.float32, "no fp8 GEMM on CPU: dequantized once"
    x = torch.randn(5, 64)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, dequantize(q, s, torch.float32)),
                               rtol=1e-5, atol=1e-4)


def test_quantization_is_validated_and_a_quantized_checkpoint_is_not_requantized():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    fp8_ckpt = ModelConfig(**{**_tiny_config_fields(), "quantization": "fp8"})
    assert resolve_quantization(None, fp8_ckpt) == "fp8"
    with pytest.raises(ValueError, match="already quantized"):
        resolve_quantization("int8", fp8_ckpt)


def _tiny_config_fields() -> dict:
    return dict(architecture="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                max_position_embeddings=8, tie_word_embeddings=True, qkv_bias=False, torch_dtype="float32",
                eos_token_ids=())


def test_an_unsupported_checkpoint_quantization_is_refused_by_name(tmp_path, smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'gptq' is not supported"):
        ModelConfig.from_dir(tmp_path)


@pytest.fixture(scope="module")
def scored_text(smollm2_dir):
    """Token ids of a stretch of English text, and the unquantized float32 model's logits over it."""
    from engine.tokenizer import Tokenizer
    text = (Path(__file__).parents[2] / "README.md").read_text()
    ids = torch.tensor(Tokenizer(smollm2_dir).encode(text)[:POSITIONS])
    return ids, _logits(smollm2_dir, ids, None)[0]


def _logits(path: Path, ids: torch.Tensor, quantization: str | None) -> tuple[torch.Tensor, int]:
    """Logits of every position, and the bytes of the layers' linear weights."""
    config = EngineConfig(dtype="float32", device="cpu", quantization=quantization).resolved()
    runner = ModelRunner(config, path, ModelConfig.from_dir(path), 512)
    logits = runner.forward_prompt(ids, torch.arange(len(ids))).float()
    linear_bytes = sum(lin.nbytes for layer in runner.model.layers
                       for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    return logits, linear_bytes


@pytest.mark.parametrize("quantization, min_agreement, max_bytes_ratio", [("int8", 0.93, 0.26), ("fp8", 0.88, 1.0)])
def test_quantized_model_agrees_with_float32_on_most_next_tokens(smollm2_dir, scored_text, quantization,
                                                                 min_agreement, max_bytes_ratio):
    ids, want = scored_text
    got, linear_bytes = _logits(smollm2_dir, ids, quantization)
    c = ModelConfig.from_dir(smollm2_dir)
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    plain_bytes = 4 * c.num_layers * (qkv_rows * c.hidden_size + c.num_heads * c.head_dim * c.hidden_size
                                      + 3 * c.intermediate_size * c.hidden_size)
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agreement >= min_agreement, f"{quantization}: top-1 agreement {agreement:.3f} over {POSITIONS}"
    assert agreement < 1.0, "quantized weights must change some logits"
    # int8: a quarter of float32 plus the scales; fp8 on CPU is dequantized at load (no fp8 GEMM)
    assert linear_bytes <= max_bytes_ratio * plain_bytes


def test_fp8_checkpoint_written_then_loaded_as_it_is(smollm2_dir, scored_text, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "0")  # the merged weight is read back as it was dequantized
    ids, want = scored_text
    out = save_fp8_checkpoint(smollm2_dir, tmp_path / "fp8")
    config = ModelConfig.from_dir(out)
    assert config.quantization == "fp8"
    stored = read_tensors(out)
    assert stored["model.layers.0.self_attn.k_proj.weight"].dtype == FP8_DTYPE
    assert stored["model.layers.0.self_attn.k_proj.weight_scale"].shape == ()
    assert stored["model.embed_tokens.weight"].dtype == torch.float32
    runner = ModelRunner(EngineConfig(dtype="float32", device="cpu").resolved(), out, config, 512)
    qkv = runner.model.layers[0].qkv
    parts = [stored[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
    scales = [stored[f"model.layers.0.self_attn.{n}_proj.weight_scale"] for n in "qkv"]
    expected = torch.cat([q.float() * s for q, s in zip(parts, scales, strict=True)])
    assert torch.equal(qkv.weight, expected), "q/k/v merged with each its own scale"
    got = runner.forward_prompt(ids, torch.arange(len(ids))).float()
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agreement >= 0.85, f"per-tensor fp8 checkpoint: top-1 agreement {agreement:.3f}"
    with pytest.raises(ValueError, match="already quantized"):
        ModelRunner(EngineConfig(dtype="float32", device="cpu", quantization="int8").resolved(), out, config, 512)


def test_generate_offline_with_int8_weights(tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"id": "a", "prompt": "The capital of France is", "max_tokens": 4,
                                    "temperature": 0}) + "\n")
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--offline", "--quantization", "int8",
                           "--dtype", "float32", "--input", str(requests), "--output", str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [line] = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(json.loads(line)["token_ids"]) == 4
