"""The rank processes of a tensor-parallel (or pipeline-parallel) engine.

Lifecycle. The engine process is rank 0: its `TPExecutor` hosts the rendezvous store, spawns ranks
1..N-1 (`run_rank`, torch.multiprocessing's spawn context, daemon processes) and joins the group.
Every rank then builds its own ModelRunner: its weight shards, a KV cache of its num_kv_heads / N
heads for every block (the block count is the smallest any rank can hold), which ranks 1..N-1 keep
in memory rank 0 maps (shared_kv.py: the worker's KV transfer runs in rank 0 and moves every rank's
heads). The scheduler, block tables, KV cache manager and sampler exist once, on rank 0.

Each step rank 0 builds the step's tensors as with one rank, sends them (with the step's block
copies) down a pipe to every other rank, pickled once; then all ranks run the same forward, meeting
in the collectives (engine/parallel/layers.py); only rank 0's logits are used. With
`enable_expert_parallel` every rank's group says so, and the MoE layers hold whole experts per rank
(expert_parallel.py) while attention stays split by heads. The pipes carry the
control messages and the process group the tensors of the forward, so an idle engine keeps no
collective waiting. `shutdown` sends "stop" and joins the ranks.

Failures. A rank whose pipe closes (rank 0 died) exits. A rank that died is reported by rank 0 as a
RuntimeError: before each step (liveness check), or when a collective breaks (the pipe carries the
rank's traceback when it had one). Group connection and collectives time out after
`tp_group.TIMEOUT_S`, so nothing waits forever on a rank that never comes.

Stages on other nodes (`distributed_executor_backend="ray"`): rank 0 starts its own stage's ranks here and
the first rank of every other stage as a Ray actor on that stage's node (ray_stages.py), which starts its
stage's other ranks there and is sent each step over TCP, passing it on (ranks.py). The rendezvous store and the
groups bind the nodes' addresses. Those stages serve their own KV (remote_stages.py): rank 0 maps only the KV
of the ranks on its node.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
import weakref
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.model.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel import ray_stages, shared_kv
from engine.parallel.expert_parallel import check_expert_parallel
from engine.parallel.pipeline import stage_layers
from engine.parallel.ranks import (
    READY_TIMEOUT_S,
    LocalRanks,
    await_ready,
    connect_groups,
    make_runner,
    rank_device,
    rank_threads,
    stop_ranks,
    to_device,
)
from engine.parallel.remote_stages import RemoteStage
from engine.parallel.sharding import check_tp_size
from engine.parallel.tp_group import host_store

logger = logging.getLogger(__name__)


def build_runner(config: EngineConfig, model_path, model_config: ModelConfig,
                 max_model_len: int) -> tuple[ModelRunner, TPExecutor | None]:
    """The engine's ModelRunner and, with tensor_parallel_size or pipeline_parallel_size > 1, the executor of
    the other ranks (started here; rank 0's runner is built beside them). Returns (runner, executor or None)."""
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        return ModelRunner(config, model_path, model_config, max_model_len), None  # (and no expert parallel)
    stage_layers(model_config.num_layers, config.pipeline_parallel_size, config.pp_layer_partition)  # checked
    check_tp_size(config.tensor_parallel_size, model_config, config.enable_expert_parallel)
    if config.enable_expert_parallel:
        check_expert_parallel(config.tensor_parallel_size, model_config)
    config = replace(config, model=str(model_path), max_model_len=max_model_len)
    executor = TPExecutor(config, model_config.num_layers)
    try:
        runner = make_runner(config, model_path, model_config, max_model_len, executor.group, executor.stage_group)
        executor.wait_ready(runner.num_blocks)
    except BaseException:
        executor.shutdown()
        raise
    runner.peers = executor
    return runner, executor


class TPExecutor:
    """Rank 0's side: starts the other ranks, mirrors each forward to them, and stops them. The ranks are a
    tensor-parallel engine's, or a pipeline-parallel engine's stages (engine/parallel/pipeline.py: the same
    processes and pipes; each stage runs its part of the forward, passing hidden states on)."""

    def __init__(self, config: EngineConfig, num_layers: int) -> None:
        """`config`: the engine's, with `model` a resolved directory and `max_model_len` set; `num_layers`:
        the model's."""
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self._tp = config.tensor_parallel_size
        self.kv_shards: list[torch.Tensor] = []
        """The KV caches of the ranks on this node, mapped here (engine/parallel/shared_kv.py)."""
        self.remote_stages: list[RemoteStage] = []
        """The stages on other nodes (the ray backend), each serving its own KV (remote_stages.py)."""
        self._links: dict[int, RemoteStage] = {}
        self._stage_layers = stage_layers(num_layers, config.pipeline_parallel_size, config.pp_layer_partition)
        self._kv_mappings: list = []
        self.dead: str | None = None
        """Why a rank is gone, once one is: the engine cannot step again (the worker must be replaced)."""
        self._send_lock = threading.Lock()
        self._threads = torch.get_num_threads()
        device = torch.device(rank_device(config.device, 0))
        if device.type == "cuda":  # unrun here (no GPU on the development machine)
            torch.cuda.set_device(device)
        self.conns: dict[int, object] = {}
        """Rank -> the connection rank 0 drives it on: the ranks it started on this node, and the first rank of
        each pipeline stage on another node (which passes each step on to its stage's other ranks)."""
        self.procs: dict[int, object] = {}
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs)
        host = None
        try:
            if config.distributed_executor_backend == "ray":
                host = ray_stages.node_ip()  # the rendezvous: this node's address as Ray knows it, not loopback
                torch.set_num_threads(rank_threads(self._tp))  # this stage's ranks share this node
                store = host_store(host, self.world_size)
                init_method = f"tcp://{host}:{store.port}"
                local = LocalRanks(range(1, self._tp), self.world_size, init_method, config, host)
                self.conns.update(local.conns)
                self.procs.update(local.procs)
                conns, procs = ray_stages.launch(range(self._tp, self.world_size, self._tp), self.world_size,
                                                 init_method, config, host, device.type == "cuda")
                self.conns.update(conns)
                self.procs.update(procs)
            else:
                torch.set_num_threads(rank_threads(self.world_size))
                store = host_store("127.0.0.1", self.world_size)
                init_method = f"tcp://127.0.0.1:{store.port}"
                local = LocalRanks(range(1, self.world_size), self.world_size, init_method, config)
                self.conns.update(local.conns)
                self.procs.update(local.procs)
            self.group, self.stage_group = connect_groups(0, config, init_method, device, store, host=host)
            """This rank's tensor-parallel group and pipeline group (None where that size is 1)."""
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self, num_blocks: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until every rank has built its runner; raise if one died or disagrees on the block count."""
        def dead() -> str | None:
            with contextlib.suppress(RuntimeError):
                self.check_alive()
                return None
            return self.dead

        for rank, handle in await_ready(self.conns, dead, num_blocks, time.monotonic() + timeout_s):
            if handle is None:  # a stage on another node: it serves its KV itself
                start, end = self._stage_layers[rank // self._tp]
                link = self._links[rank] = RemoteStage(rank // self._tp, start, end - start, self.conns[rank],
                                                       lambda message, rank=rank: self.send_to(rank, message))
                self.remote_stages.append(link)
                continue
            kv_cache, mapping = shared_kv.open_handle(handle)
            self.kv_shards.append(kv_cache)
            self._kv_mappings.append(mapping)

    def send(self, message: tuple) -> None:
        """Hand a forward ("step" or "prompt" and its arguments) to every other rank."""
        self.check_alive()
        data = pickle.dumps(to_device(message, torch.device("cpu")), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in self.conns:
            self._send_bytes(rank, data)

    def send_to(self, rank: int, message: tuple) -> None:
        """A control message to one rank (a remote stage's KV sender, remote_stages.py)."""
        self._send_bytes(rank, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_bytes(self, rank: int, data: bytes) -> None:
        try:
            with self._send_lock:
                self.conns[rank].send_bytes(data)
        except OSError as exc:
            raise RuntimeError(f"{self._name(rank)} is gone ({exc})") from exc

    @contextlib.contextmanager
    def watch(self):
        """Around rank 0's forward: a collective broken by a dead rank is reported as that rank's death."""
        try:
            yield
        except RuntimeError as exc:
            deadline = time.monotonic() + 5.0  # a rank that broke the collective may still be exiting
            while time.monotonic() < deadline:
                try:
                    self.check_alive()
                except RuntimeError as dead:
                    raise dead from exc
                time.sleep(0.1)
            raise

    def broken(self) -> str | None:
        """Why a rank is gone, looking now (None: every rank runs)."""
        with contextlib.suppress(RuntimeError):
            self.check_alive()
        return self.dead

    def check_alive(self) -> None:
        """Raise RuntimeError naming the first rank that is gone (and remember it: `dead`)."""
        try:
            self._check_alive()
        except RuntimeError as exc:
            self.dead = self.dead or str(exc)
            raise

    def _check_alive(self) -> None:
        for rank, proc in self.procs.items():
            conn, link = self.conns[rank], self._links.get(rank)
            if proc.is_alive() and (link is None or link.error is None):
                continue
            detail = ""
            if link is not None:  # its reader owns the connection
                detail = f": {link.error}" if link.error else ""
            else:
                with contextlib.suppress(Exception):
                    if conn.poll():
                        kind, value = pickle.loads(conn.recv_bytes())
                        detail = f":\n{value}" if kind == "error" else ""
            raise RuntimeError(f"{self._name(rank)} exited (exit code {proc.exitcode}){detail}")

    def _name(self, rank: int) -> str:
        """A rank as errors name it: a pipeline stage (its first rank, on another node, or with one rank per
        stage), else a tensor-parallel rank."""
        if rank in self._links or self._tp == 1:
            return f"pipeline stage {rank // self._tp}"
        return f"tensor-parallel rank {rank}"

    def shutdown(self) -> None:
        """Stop the other ranks (waiting for them) and release the group."""
        self._finalizer()
        for name in ("group", "stage_group"):
            group = getattr(self, name, None)
            if group is not None:
                group.close()
                setattr(self, name, None)
        torch.set_num_threads(self._threads)


def _stop(conns: dict, procs: dict) -> None:
    stop_ranks(list(conns.values()), list(procs.values()))
