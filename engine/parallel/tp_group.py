"""One rank's view of the tensor-parallel group, and the collectives the sharded model needs.

The group is a torch.distributed backend object made directly (gloo on CPU, nccl on CUDA) over a
TCPStore that rank 0 hosts, not the global default group: several engines may live in one process
(tests), and nothing else in the process sees or needs `torch.distributed` state.

  all_reduce(x)        x = the sum of every rank's x, in place (row-parallel linears, embedding)
  all_gather(x, dim)   the ranks' x concatenated along `dim` in rank order (vocab-parallel LM head)
  min(n)               the smallest of the ranks' integers (KV blocks every rank can hold)
  send(x, dst), recv(x, src)   point to point (a pipeline's stages, pipeline.py, use the same group type)

`expert_parallel`: the MoE layers split whole experts over this group's ranks (expert_parallel.py)
instead of a slice of every expert; attention and the dense layers stay tensor-parallel either way.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT_S = 300.0
"""How long a rank waits for the others: at connection and inside each collective (a rank that never
arrives surfaces as an error, not a hang)."""


def host_store(host: str = "127.0.0.1", world_size: int = 1, timeout_s: float = TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (`store.port`); the other ranks connect to it."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class TPGroup:
    def __init__(self, rank: int, world_size: int, device: torch.device, backend, store,
                 expert_parallel: bool = False) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.expert_parallel = expert_parallel
        """Whole experts per rank in the MoE layers (EngineConfig.enable_expert_parallel)."""
        self._store = store
        """Kept alive with the group (rank 0's TCPStore serves the others)."""

    @classmethod
    def connect(cls, rank: int, world_size: int, init_method: str, device: torch.device,
                store: dist.TCPStore | None = None, timeout_s: float = TIMEOUT_S,
                expert_parallel: bool = False, name: str = "tp", local_host: str | None = None) -> TPGroup:
        """Join the group `name` at `init_method` (tcp://host:port of rank 0's store; rank 0 passes its store;
        several groups share one store under their own names). `local_host`: this process's own address when
        the ranks span nodes (default: the store's host, all ranks on its node). Blocks until every rank has
        joined, or raises after `timeout_s`."""
        timeout = timedelta(seconds=timeout_s)
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        if store is None:
            store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
        if device.type == "cuda":  # unrun here (no GPU on the development machine)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, world_size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host or host)]
            backend = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world_size, options)
        return cls(rank, world_size, device, backend, store, expert_parallel)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x = sum over ranks, in place; returns x."""
        self.backend.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.backend.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point to point: `x` (contiguous) to rank `dst` (pipeline stages, engine/parallel/pipeline.py)."""
        self.backend.send([x], dst, 0).wait()

    def isend(self, x: torch.Tensor, dst: int):
        """`send` without waiting: the backend's work (`wait()`, `is_completed()`); keep `x` until it completes."""
        return self.backend.send([x], dst, 0)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Point to point: fill `x` with what rank `src` sends; returns x."""
        self.backend.recv([x], src, 0).wait()
        return x

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.backend.allreduce([t], _min_options()).wait()
        return int(t.item())

    def close(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # already broken (a rank died): nothing left to release
                pass
        self.backend = None
        self._store = None


def _min_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    return options
