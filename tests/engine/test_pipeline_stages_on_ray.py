"""Pipeline stages as Ray actors (`distributed_executor_backend="ray"`, engine/parallel/ray_stages.py): the stage
on the other "node" joins over TCP at this node's Ray address, computes its layers, and serves their KV from a
sender of its own (engine/parallel/remote_stages.py); the worker's sender stands for both stages
(kv_transfer/layer_split.py).

One local Ray cluster (this machine) stands for the nodes: what crosses between the stages is exactly what
crosses between hosts (the control connection, gloo, the stage's KV sender); tests/multihost/ puts the stages
on network-namespace hosts.
"""
import dataclasses
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.ray_stages import StageProcess
from engine.sampling_params import SamplingParams
from kv_transfer import KVLayout, KVTransferConfig, TransferState
from kv_transfer.sharded import ShardedKV
from tests.engine.test_pipeline_parallel import GREEDY, SEEDED
from tests.engine.test_tensor_parallel import tiny_prompts
from worker_runtime.transfer_sides import open_sides

pytestmark = pytest.mark.slow  # a Ray cluster and stage actors
CONFIG = KVTransferConfig(backend="tcp", host="127.0.0.1", default_timeout_s=30)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def engine(model_dir, pp: int, backend: str = "mp", tp: int = 1) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", pipeline_parallel_size=pp,
                                  tensor_parallel_size=tp, distributed_executor_backend=backend,
                                  cache=CacheConfig(num_blocks=64)))


def run(eng: LLMEngine, prompts, params):
    tokens = [[c.token_ids for c in o.completions] for o in eng.generate(prompts, params)]
    assert not eng.has_unfinished() and eng.kv.pool.num_used_blocks == 0
    return tokens


def test_stages_on_ray_equal_one_process_and_serve_their_own_kv(local_ray, tiny_qwen2_4l_dir):
    """Two stages of two ranks: the stage actor starts its second rank itself, forwards it each step, and serves
    the KV of both (their head ranges) from its sender. (One rank per stage runs across three hosts in
    tests/multihost/test_stages_across_hosts.py.)"""
    tp = 2
    prompts = tiny_prompts()
    forks = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3)
    params = [GREEDY] * (len(prompts) - 3) + [SEEDED, forks, forks]
    one = engine(tiny_qwen2_4l_dir, 1)
    staged = engine(tiny_qwen2_4l_dir, 2, "ray", tp)
    sides = None
    try:
        assert len(staged.runner.remote_stages()) == 1 and staged.runner.kv_stages == 1
        assert len(staged.runner.kv_shards()) == tp  # this node's ranks: its stage's
        assert staged.runner.kv_cache.shape[1] == 2  # this node holds layers [0, 2) only
        assert run(staged, prompts, params) == run(one, prompts, params)

        # The same prompt alone on both engines lands in the same blocks: pull them from the two stages'
        # senders into a whole pool and compare with the one-process engine's KV.
        prompt = [[int(t) for t in torch.arange(40) % 97 + 5]]
        run(one, prompt, [GREEDY])
        run(staged, prompt, [GREEDY])
        blocks, _ = staged.lease_cached_prefix("x", prompt[0])
        expected_blocks, _ = one.lease_cached_prefix("x", prompt[0])
        assert len(blocks) == len(expected_blocks) == 2
        shards = staged.runner.kv_shards()
        pool = ShardedKV(shards)
        layout = KVLayout.of_kv_cache(pool, Path(staged.model_path).name)
        sides = open_sides(pool, layout, CONFIG, staged.runner.remote_stages())
        info = sides.sender.peer_info()
        assert [(s["first_layer"], s["num_layers"]) for s in info["stages"]] == [(0, 2), (2, 2)]
        lease = sides.sender.expect("p", blocks, timeout_s=30)
        dst = torch.zeros_like(one.runner.kv_cache)
        whole = dataclasses.replace(layout, num_layers=4)
        pulled = open_sides(dst, whole, CONFIG)
        try:
            pull = pulled.receiver.read(info, "p", blocks, blocks, timeout_s=30, capability=lease.capability)
            assert pull.wait(30) == TransferState.DONE, pull.error
            assert lease.wait(10) == TransferState.DONE
            assert all(p.bytes_moved == len(blocks) * whole.block_nbytes // 2 for p in pull.pieces)
        finally:
            pulled.close()
        torch.testing.assert_close(dst[blocks], one.runner.kv_cache[expected_blocks], rtol=0, atol=1e-5)

        # The stage's node is lost: a lease it holds fails, the idle engine says it is broken (naming the stage),
        # and so does the next step.
        lease = sides.sender.expect("q", blocks, timeout_s=30)
        assert staged.broken() is None
        stage_actor = next(p.actor for p in staged.executor.procs.values() if isinstance(p, StageProcess))
        local_ray.kill(stage_actor, no_restart=True)
        assert lease.wait(30) == TransferState.FAILED
        assert "pipeline stage 1" in staged.broken()
        with pytest.raises(RuntimeError, match="pipeline stage 1"):
            run(staged, prompt, [GREEDY])
    finally:
        if sides is not None:
            sides.close()
        staged.shutdown()
        one.shutdown()
