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

`run_rank(rank, world_size, init_method, config, conn)` is a plain function: another launcher (a Ray
placement group) can start the same loop with anything that has `send_bytes` / `recv_bytes` / `poll`.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import pickle
import threading
import time
import traceback
import weakref
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.model.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel import ray_stages, shared_kv
from engine.parallel.expert_parallel import check_expert_parallel
from engine.parallel.pipeline import PipelineStage, stage_layers
from engine.parallel.remote_stages import RemoteStage, StageKVServer
from engine.parallel.sharding import check_tp_size
from engine.parallel.tp_group import TPGroup, host_store

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 300.0


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


def run_rank(rank: int, world_size: int, init_method: str, config: EngineConfig, conn, host: str | None = None) -> None:
    """Rank `rank` (>= 1): join the group, load this rank's shard, then run the steps rank 0 sends until
    "stop" (or until its connection closes). `config` is rank 0's, with the model path and max_model_len
    resolved. `host`: this rank is a pipeline stage on another node (ray_stages.py), at that address; it
    serves its KV from a sender of its own (remote_stages.py) instead of exporting it to rank 0."""
    lock = threading.Lock()

    def send(message: tuple) -> None:  # the loop and the KV sender's threads share the connection
        with lock:
            conn.send_bytes(pickle.dumps(message))

    kv_server = None
    try:
        torch.set_num_threads(rank_threads(world_size) if host is None else max(1, torch.get_num_threads()))
        local = rank_device(config.device, 0 if host is not None else rank)  # a remote stage: its node's device
        config = replace(config, device=local)
        device = torch.device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp, pp = connect_groups(rank, config, init_method, device, host=host)
        model_config = ModelConfig.from_dir(config.model)
        runner = make_runner(config, config.model, model_config, config.max_model_len, tp, pp)
        if host is not None:
            kv_server = StageKVServer(runner.kv_cache, host, send)
        send(("ready", runner.num_blocks, None if host is not None else runner.kv_export))
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # rank 0 is gone
                break
            kind, args = message[0], message[1:]
            if kind == "stop":
                break
            if kind == "step":
                runner.run_step(*_to_device(args, device))
            elif kind == "prompt":
                runner.forward_prompt(*_to_device(args, device))
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


def connect_groups(rank: int, config: EngineConfig, init_method: str, device: torch.device,
                   store=None, host: str | None = None) -> tuple[TPGroup | None, TPGroup | None]:
    """Process `rank`'s groups, (tensor-parallel, pipeline): with K stages of N ranks, rank s*N + t is rank t of
    stage s's tensor-parallel group `tp<s>` and stage s of the pipeline `pp<t>` (the ranks of one tensor-parallel
    position, one per stage, pass hidden states to each other). None where that size is 1."""
    n, k = config.tensor_parallel_size, config.pipeline_parallel_size
    stage, position = divmod(rank, n)
    tp = pp = None
    if n > 1:
        tp = TPGroup.connect(position, n, init_method, device, store=store,
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


class TPExecutor:
    """Rank 0's side: starts the other ranks, mirrors each forward to them, and stops them. The ranks are a
    tensor-parallel engine's, or a pipeline-parallel engine's stages (engine/parallel/pipeline.py: the same
    processes and pipes; each stage runs its part of the forward, passing hidden states on)."""

    def __init__(self, config: EngineConfig, num_layers: int) -> None:
        """`config`: the engine's, with `model` a resolved directory and `max_model_len` set; `num_layers`:
        the model's."""
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.kind = "pipeline stage" if config.tensor_parallel_size == 1 else "tensor-parallel rank"
        """What the other processes are, in errors."""
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
        self.conns, self.procs = [], []
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs)
        host = None
        try:
            if config.distributed_executor_backend == "ray":
                host = ray_stages.node_ip()  # the rendezvous: this node's address as Ray knows it, not loopback
                store = host_store(host, self.world_size)
                init_method = f"tcp://{host}:{store.port}"
                conns, procs = ray_stages.launch(self.world_size, init_method, config, host,
                                                 device.type == "cuda")
            else:
                torch.set_num_threads(rank_threads(self.world_size))
                store = host_store("127.0.0.1", self.world_size)
                init_method = f"tcp://127.0.0.1:{store.port}"
                conns, procs = _spawn(self.world_size, init_method, config)
            self.conns.extend(conns)
            self.procs.extend(procs)
            self.group, self.stage_group = connect_groups(0, config, init_method, device, store, host=host)
            """This rank's tensor-parallel group and pipeline group (None where that size is 1)."""
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self, num_blocks: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until every rank has built its runner; raise if one died or disagrees on the block count."""
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self.conns, 1):
            while not conn.poll(0.1):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.kind} {rank} not ready after {timeout_s:.0f} s")
            kind, value, *kv_handle = pickle.loads(conn.recv_bytes())
            if kind == "error":
                raise RuntimeError(f"{self.kind} {rank} failed:\n{value}")
            if value != num_blocks:
                raise RuntimeError(f"{self.kind} {rank} has {value} KV blocks, rank 0 {num_blocks}")
            if kv_handle[0] is None:  # a stage on another node: it serves its KV itself
                start, end = self._stage_layers[rank]
                link = self._links[rank] = RemoteStage(rank, start, end - start, conn, self.send_to)
                self.remote_stages.append(link)
                continue
            kv_cache, mapping = shared_kv.open_handle(kv_handle[0])
            self.kv_shards.append(kv_cache)
            self._kv_mappings.append(mapping)

    def send(self, message: tuple) -> None:
        """Hand a forward ("step" or "prompt" and its arguments) to every other rank."""
        self.check_alive()
        data = pickle.dumps(_to_device(message, torch.device("cpu")), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(1, self.world_size):
            self._send_bytes(rank, data)

    def send_to(self, rank: int, message: tuple) -> None:
        """A control message to one rank (a remote stage's KV sender, remote_stages.py)."""
        self._send_bytes(rank, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_bytes(self, rank: int, data: bytes) -> None:
        try:
            with self._send_lock:
                self.conns[rank - 1].send_bytes(data)
        except OSError as exc:
            raise RuntimeError(f"{self.kind} {rank} is gone ({exc})") from exc

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
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1):
            link = self._links.get(rank)
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
            raise RuntimeError(f"{self.kind} {rank} exited (exit code {proc.exitcode}){detail}")

    def shutdown(self) -> None:
        """Stop the other ranks (waiting for them) and release the group."""
        self._finalizer()
        for name in ("group", "stage_group"):
            group = getattr(self, name, None)
            if group is not None:
                group.close()
                setattr(self, name, None)
        torch.set_num_threads(self._threads)


def _spawn(world_size: int, init_method: str, config: EngineConfig) -> tuple[list, list]:
    """Ranks 1..world_size-1 as processes of this node, each on a pipe: (the pipes, the processes)."""
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(1, world_size):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=run_rank, args=(rank, world_size, init_method, config, theirs),
                           name=f"pdserve-tp-rank{rank}", daemon=True)
        proc.start()
        theirs.close()
        conns.append(ours)
        procs.append(proc)
    return conns, procs


def _stop(conns: list, procs: list, timeout_s: float = 10.0) -> None:
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


def _to_device(obj, device: torch.device):
    """`obj` with every tensor in it (in tuples, lists, dicts and dataclasses such as AttentionMetadata)
    on `device`, compact (a view of a larger buffer is copied, so only its own elements get pickled)."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device and obj.is_contiguous() and obj.numel() == obj.untyped_storage().nbytes() // max(
                1, obj.element_size()):
            return obj
        return obj.to(device).clone() if obj.device == device else obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = copy.copy(obj)
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, _to_device(getattr(obj, f.name), device))
        return obj
    return obj
