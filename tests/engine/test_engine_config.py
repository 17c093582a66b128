"""EngineConfig: `auto` device and attention backend resolved where the engine runs; bad values refused."""
import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from pdserve.cli import build_parser, engine_config_from_args


def test_auto_stays_auto_until_resolved_on_this_machine():
    config = EngineConfig()
    assert config.device == "auto" and config.attention_backend == "auto"  # a head ships it as is
    resolved = config.resolved()
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolved.device == want
    assert resolved.attention_backend == ("triton" if want == "cuda" else "torch")
    assert config.device == "auto"  # a copy


def test_explicit_choices_are_kept():
    resolved = EngineConfig(device="cpu", attention_backend="triton").resolved()
    assert (resolved.device, resolved.attention_backend) == ("cpu", "triton")
    assert EngineConfig(device="cuda:1").resolved().attention_backend == "triton"


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "tpu"}, "device must be"),
    ({"attention_backend": "xformers"}, "attention_backend must be"),
])
def test_bad_engine_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_range(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=value)


def test_cli_flags_map_onto_the_config():
    args = build_parser().parse_args(["generate", "--offline", "--input", "a", "--output", "b",
                                      "--device", "cpu", "--attention-backend", "triton",
                                      "--gpu-memory-utilization", "0.5", "--enforce-eager"])
    config = engine_config_from_args(args)
    assert (config.device, config.attention_backend, config.cuda_graphs) == ("cpu", "triton", False)
    assert config.cache.gpu_memory_utilization == 0.5 and config.cache.kv_cache_memory_bytes is None
    args = build_parser().parse_args(["generate", "--offline", "--input", "a", "--output", "b",
                                      "--kv-cache-memory-gib", "0.25"])
    config = engine_config_from_args(args)
    assert config.device == "auto" and config.cache.kv_cache_memory_bytes == 1 << 28
