"""The other ranks of a tensor- or pipeline-parallel engine: their loop (`run_rank`), how they are started on a
node (`spawn_ranks`) and how their readiness is awaited (`await_ready`); rank 0's side is executor.py.

A rank joins its groups (`connect_groups`), builds its ModelRunner (`make_runner`) and reports "ready" with its
block count and the handle of its KV cache (shared_kv.py), then runs the steps its parent sends until "stop" (or
until its connection closes). A pipeline stage on another node (ray_stages.py) is a *stage leader*: it starts its
stage's other tensor-parallel ranks on its node, maps their KV, forwards them every step, and serves the stage's
KV (every layer of its range, every head) from a sender of its own (remote_stages.py) instead of exporting it.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import pickle
import threading
import time
import traceback
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.model.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel import shared_kv
from engine.parallel.pipeline import PipelineStage, stage_layers
from engine.parallel.remote_stages import StageKVServer
from engine.parallel.tp_group import TPGroup
from kv_transfer.sharded import ShardedKV

READY_TIMEOUT_S = 300.0
FORWARDED = ("step", "prompt", "stop")
"""What a stage leader passes on to its stage's other ranks."""


def rank_threads(world_size: int) -> int:
    """torch threads per rank: this machine's cores shared evenly (at least one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world_size)


def rank_device(device: str, rank: int) -> str:
    """cuda[:k] -> cuda:(k + rank) (one GPU per rank); cpu stays cpu."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def run_rank(rank: int, world_size: int, init_method: str, config: EngineConfig, conn, host: str | None = None,
             leader: bool = False) -> None:
    """Rank `rank` (>= 1): join the groups, load this rank's shard, then run the steps its parent sends until
    "stop" (or until its connection closes). `config` is rank 0's, with the model path and max_model_len
    resolved. `host`: this node's address when the ranks span nodes (the groups bind it). `leader`: the first
    rank of a pipeline stage on another node (ray_stages.py), which starts its stage's other ranks and serves
    the stage's KV itself."""
    lock = threading.Lock()

    def send(message: tuple) -> None:  # the loop and the KV sender's threads share the connection
        with lock:
            conn.send_bytes(pickle.dumps(message))

    kv_server = local = None
    tp_size = config.tensor_parallel_size
    try:
        torch.set_num_threads(rank_threads(world_size if host is None else tp_size))  # (the ranks on this node)
        if leader and tp_size > 1:  # this stage's other ranks, on this node
            local = LocalRanks(range(rank + 1, rank + tp_size), world_size, init_method, config, host)
        config = replace(config, device=rank_device(config.device, rank % tp_size if host else rank))
        device = torch.device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp, pp = connect_groups(rank, config, init_method, device, host=host)
        model_config = ModelConfig.from_dir(config.model)
        runner = make_runner(config, config.model, model_config, config.max_model_len, tp, pp)
        if leader:
            shards = [runner.kv_cache] + (local.await_ready(runner.num_blocks) if local is not None else [])
            kv_server = StageKVServer(shards[0] if len(shards) == 1 else ShardedKV(shards), host, send)
        send(("ready", runner.num_blocks, None if leader else runner.kv_export))
        while True:
            try:
                raw = conn.recv_bytes()
            except (EOFError, OSError):  # the parent is gone
                break
            kind, *args = pickle.loads(raw)
            if local is not None and kind in FORWARDED:
                local.forward(raw)
            if kind == "stop":
                break
            if kind == "step":
                runner.run_step(*to_device(args, device))
            elif kind == "prompt":
                runner.forward_prompt(*to_device(args, device))
            elif kv_server is not None:
                kv_server.handle(kind, args)
        for group in (tp, pp):
            if group is not None:
                group.close()
    except BaseException:
        with contextlib.suppress(Exception):
            send(("error", traceback.format_exc()))
        raise
    finally:
        if kv_server is not None:
            kv_server.close()
        if local is not None:
            local.stop()


def connect_groups(rank: int, config: EngineConfig, init_method: str, device: torch.device,
                   store=None, host: str | None = None) -> tuple[TPGroup | None, TPGroup | None]:
    """Process `rank`'s groups, (tensor-parallel, pipeline): with K stages of N ranks, rank s*N + t is rank t of
    stage s's tensor-parallel group `tp<s>` and stage s of the pipeline `pp<t>` (the ranks of one tensor-parallel
    position, one per stage, pass hidden states to each other). None where that size is 1."""
    n, k = config.tensor_parallel_size, config.pipeline_parallel_size
    stage, position = divmod(rank, n)
    tp = pp = None
    if n > 1:
        tp = TPGroup.connect(position, n, init_method, device, store=store, local_host=host,
                             expert_parallel=config.enable_expert_parallel, name=f"tp{stage}")
    if k > 1:  # every stage's tensor-parallel groups exist before any pipeline group is made: no rank waits on
        pp = TPGroup.connect(stage, k, init_method, device, store=store, name=f"pp{position}",  # one that waits
                             local_host=host)
    return tp, pp


def make_runner(config: EngineConfig, model_path, model_config: ModelConfig, max_model_len: int,
                tp: TPGroup | None, pp: TPGroup | None) -> ModelRunner:
    """A process's ModelRunner: its shard of its stage's layers (with `connect_groups`' groups)."""
    stage = None
    if pp is not None:
        ranges = stage_layers(model_config.num_layers, config.pipeline_parallel_size, config.pp_layer_partition)
        stage = PipelineStage(pp.rank, pp.world_size, *ranges[pp.rank], pp)
    return ModelRunner(config, model_path, model_config, max_model_len, tp=tp, stage=stage)


class LocalRanks:
    """Ranks a process starts on its own node (spawned processes, each on a pipe) and whose KV it maps: rank 0's
    others on one node, or a stage leader's stage on another (`host`: that node's address)."""

    def __init__(self, ranks, world_size: int, init_method: str, config: EngineConfig,
                 host: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conns: dict[int, object] = {}
        self.procs: dict[int, object] = {}
        self._mappings: list = []
        for rank in ranks:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=run_rank, args=(rank, world_size, init_method, config, theirs, host),
                               name=f"pdserve-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.conns[rank], self.procs[rank] = ours, proc

    def await_ready(self, num_blocks: int, timeout_s: float = READY_TIMEOUT_S) -> list[torch.Tensor]:
        """Their KV caches, mapped, once every one is ready; raises if one failed or disagrees on the blocks."""
        shards = []
        for _, handle in await_ready(self.conns, self.dead, num_blocks, time.monotonic() + timeout_s):
            kv_cache, mapping = shared_kv.open_handle(handle)
            shards.append(kv_cache)
            self._mappings.append(mapping)
        return shards

    def dead(self) -> str | None:
        """Why a rank is gone (None: all run)."""
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                return f"rank {rank} exited (exit code {proc.exitcode})"
        return None

    def forward(self, raw: bytes) -> None:
        for rank, conn in self.conns.items():
            try:
                conn.send_bytes(raw)
            except OSError as exc:
                raise RuntimeError(f"rank {rank} is gone ({exc})") from exc

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_ranks(list(self.conns.values()), list(self.procs.values()), timeout_s)


def await_ready(conns: dict, dead, num_blocks: int, deadline: float):
    """(rank, its KV handle, None for a stage that serves its KV itself) for each of `conns` once it reports
    ready, in rank order. Raises RuntimeError when `dead()` says one is gone or a rank failed or holds another
    number of blocks, TimeoutError past `deadline`."""
    for rank, conn in sorted(conns.items()):
        while not conn.poll(0.1):
            if (why := dead()) is not None:
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} not ready in time")
        kind, value, *handle = pickle.loads(conn.recv_bytes())
        if kind == "error":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        if value != num_blocks:
            raise RuntimeError(f"rank {rank} has {value} KV blocks, rank 0 {num_blocks}")
        yield rank, handle[0]


def stop_ranks(conns: list, procs: list, timeout_s: float = 10.0) -> None:
    """Send "stop", wait for the processes (killing those that do not end in time), close the connections."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(("stop",)))
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


def to_device(obj, device: torch.device):
    """`obj` with every tensor in it (in tuples, lists, dicts and dataclasses such as AttentionMetadata)
    on `device`, compact (a view of a larger buffer is copied, so only its own elements get pickled)."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device and obj.is_contiguous() and obj.numel() == obj.untyped_storage().nbytes() // max(
                1, obj.element_size()):
            return obj
        return obj.to(device).clone() if obj.device == device else obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = copy.copy(obj)
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, to_device(getattr(obj, f.name), device))
        return obj
    return obj
