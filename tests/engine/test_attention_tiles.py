"""The paged-attention kernel's tile table (engine/attention/tile_table.py): validated tiles, defaults off
CUDA and where nothing was tuned, a tuned entry used for its own device and shape only, an unreadable file
falling back to the defaults; and bench/tune_attention_tiles.py checking candidates under the interpreter."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.attention import tile_table
from engine.attention.tile_table import DEFAULT_TILES, Tiles, save_tiles, tile_key, tiles_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A tiles file of the test's own, on a pretend CUDA device named "Test GPU"."""
    path = tmp_path / "tiles.json"
    monkeypatch.setenv("PDSERVE_ATTENTION_TILES", str(path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    tiles_for.cache_clear()
    yield path
    tiles_for.cache_clear()
    tile_table._loaded.clear()


def test_tiles_are_validated():
    for bad in (dict(block_m=8, tile=32), dict(block_m=64, tile=48), dict(block_m=64, tile=64, num_warps=3),
                dict(block_m=64, tile=64, num_stages=0)):
        with pytest.raises(ValueError):
            Tiles(**bad)
    assert Tiles(64, 64).launch_options() == {} and Tiles(64, 64, 8, 2).launch_options() == {"num_warps": 8,
                                                                                            "num_stages": 2}


def test_a_tuned_entry_serves_its_device_and_shape_only(table):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    tuned = Tiles(128, 32, 8, 3)
    save_tiles(table, tile_key("Test GPU", "prefill", torch.bfloat16, 64, 4), tuned)
    save_tiles(table, tile_key("Other GPU", "prefill", torch.bfloat16, 64, 4), Tiles(32, 32))  # kept beside
    assert len(json.loads(table.read_text())) == 2
    assert tiles_for(cuda, "prefill", torch.bfloat16, 64, 4) == tuned
    assert tiles_for(cuda, "decode", torch.bfloat16, 64, 4) == DEFAULT_TILES["decode"]
    assert tiles_for(cuda, "prefill", torch.float16, 64, 4) == DEFAULT_TILES["prefill"]
    assert tiles_for(cuda, "prefill", torch.bfloat16, 128, 4) == DEFAULT_TILES["prefill"]
    assert tiles_for(cpu, "prefill", torch.bfloat16, 64, 4) == DEFAULT_TILES["prefill"]  # never looked up off CUDA
    # a program holds a whole KV group: block_m grows to the group's power of two
    assert tiles_for(cpu, "decode", torch.bfloat16, 64, 20) == Tiles(32, DEFAULT_TILES["decode"].tile)


def test_an_unreadable_file_leaves_the_defaults(table, caplog):
    table.write_text('{"Test GPU|prefill|bfloat16|d64|g4": {"block_m": 7, "tile": 64}}')
    assert tiles_for(torch.device("cuda"), "prefill", torch.bfloat16, 64, 4) == DEFAULT_TILES["prefill"]
    assert "unreadable" in caplog.text


def test_the_tuner_checks_and_times_candidates_under_the_interpreter(tmp_path):
    pytest.importorskip("triton", reason="the triton wheel is part of the test install")
    out = tmp_path / "tune.json"
    args = ["--kind", "prefill", "--dtype", "float32", "--head-dim", "16", "--heads", "4", "--kv-heads", "2",
            "--seqs", "2", "--query-len", "20", "--context", "9", "--iters", "1", "--limit", "3", "--output", str(out)]
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "tune_attention_tiles.py"), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["tiles"] for r in result["results"]][0] == {"block_m": 64, "tile": 64, "num_warps": None,
                                                          "num_stages": None}  # the default first
    assert len(result["results"]) == 3 and all("ms" in r for r in result["results"])  # each equal to it
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "tune_attention_tiles.py"), *args, "--save"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "needs a CUDA GPU" in refused.stderr
