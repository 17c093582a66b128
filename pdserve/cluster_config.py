"""The configuration of `pdserve serve` (pdserve/cluster.py): the pools, Ray, and the router, worker and planner
configs it runs with. Its fields' metadata make serve's flags (pdserve/command_flags.py)."""
from __future__ import annotations

import dataclasses
import os

from pdserve.ray_network import AUTH_MODE_ENV, check_ray_auth
from planner.config import PlannerConfig
from router.config import RouterConfig
from worker_runtime.config import WorkerConfig


@dataclasses.dataclass
class ClusterConfig:
    router: RouterConfig = dataclasses.field(metadata={"group": "router"})
    worker: WorkerConfig = dataclasses.field(metadata={"group": "worker"})
    """Template for every worker (role and port are set per worker)."""
    num_prefill: int = dataclasses.field(default=1, metadata={
        "flag": "--prefill", "help": "prefill workers (0: decode workers prefill)"})
    num_decode: int = dataclasses.field(default=1, metadata={"flag": "--decode", "help": "decode workers"})
    ray_address: str | None = dataclasses.field(default=None, metadata={
        "help": "join this Ray cluster instead of starting one"})
    log_level: str = "WARNING"
    internal_tls: bool = dataclasses.field(default=False, metadata={
        "group": "security",
        "help": "mutual TLS on router -> worker gRPC and the KV links, with a throwaway CA made at start (needs "
                "the openssl command; one host only)"})
    """Mutual TLS on router -> worker gRPC and the KV links, with certificates of a throwaway CA made
    at start (one host only: the files live in a private temporary directory)."""

    prefill_tensor_parallel_size: int | None = dataclasses.field(default=None, metadata={
        "help": "ranks of each prefill worker (default: --tensor-parallel-size); prefill and decode may differ, "
                "their KV moves between any two sizes"})
    """Ranks of each prefill worker (None: the worker template's --tensor-parallel-size)."""
    decode_tensor_parallel_size: int | None = dataclasses.field(default=None, metadata={
        "help": "ranks of each decode worker (default: --tensor-parallel-size)"})
    """Ranks of each decode worker (None: the worker template's); may differ from prefill's."""
    prefill_pipeline_parallel_size: int | None = dataclasses.field(default=None, metadata={
        "help": "pipeline stages of each prefill worker (default: --pipeline-parallel-size); its KV moves to "
                "decode workers of any shape"})
    """Pipeline stages of each prefill worker (None: the worker template's --pipeline-parallel-size)."""
    decode_pipeline_parallel_size: int | None = dataclasses.field(default=None, metadata={
        "help": "pipeline stages of each decode worker (default: --pipeline-parallel-size)"})
    """Pipeline stages of each decode worker (None: the worker template's); may differ from prefill's."""
    pipeline_across_nodes: bool = dataclasses.field(default=False, metadata={
        "help": "with --ray-address: each worker with pipeline stages puts one stage per node (a Ray placement "
                "group, STRICT_SPREAD), each stage serving the KV of its layers itself"})
    """With ray_address: a worker of K pipeline stages runs them on K nodes (pdserve/stage_groups.py), each
    stage's tensor-parallel ranks on its node."""
    follow_ray_nodes: bool = dataclasses.field(default=False, metadata={
        "help": "with --ray-address: run a worker per unit of pdserve_<role> each node declares, as nodes join "
                "and leave (a RayCluster resized by `pdserve planner`)"})
    """With ray_address: every node declaring `pdserve_<role>: N` runs N workers of the role, as nodes come
    and go (the chart's RayCluster resized by `pdserve planner`); see NodeSupervisor.follow_nodes."""
    planner: PlannerConfig | None = dataclasses.field(default=None, metadata={
        "flag": "--planner", "group": "planner",
        "help": "resize the prefill and decode pools from live TTFT/ITL (starting from --prefill and --decode), "
                "draining workers before removing them"})
    """`--planner`: resize the pools from live TTFT/ITL (planner/), starting from num_prefill/num_decode."""
    ray_auth_mode: str = dataclasses.field(default_factory=lambda: os.environ.get(AUTH_MODE_ENV, ""))
    """Ray's RAY_AUTH_MODE (Ray reads it from the environment): `token` is needed to join other hosts."""

    def most_workers(self, role: str) -> int:
        """Workers of `role` there may be at once: the planner's max, else the count asked for (a private
        Ray cluster gets a CPU per rank of them, so a scale-up is never left pending)."""
        count = getattr(self, f"num_{role}")
        return max(count, self.planner.bounds(role).max_workers) if self.planner is not None else count

    def tensor_parallel_size(self, role: str) -> int:
        size = getattr(self, f"{role}_tensor_parallel_size")
        return self.worker.engine.tensor_parallel_size if size is None else size

    def pipeline_parallel_size(self, role: str) -> int:
        size = getattr(self, f"{role}_pipeline_parallel_size")
        return self.worker.engine.pipeline_parallel_size if size is None else size

    def ranks(self, role: str) -> int:
        """Processes (devices on CUDA) of one worker of `role`: its tensor-parallel ranks times its stages."""
        return self.tensor_parallel_size(role) * self.pipeline_parallel_size(role)

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            for kind in ("tensor", "pipeline"):
                size = getattr(self, f"{role}_{kind}_parallel_size")
                if size is not None and size < 1:
                    raise ValueError(f"--{role}-{kind}-parallel-size must be >= 1, got {size}")
        if self.internal_tls and self.ray_address is not None:
            raise ValueError("--internal-tls makes certificates on this machine only; with --ray-address give "
                             "--internal-tls-cert/--internal-tls-key/--internal-tls-ca files present on every node")
        if self.internal_tls and (self.worker.tls.enabled or self.router.worker_tls.enabled):
            raise ValueError("--internal-tls makes its own certificates: not with --internal-tls-cert/key/ca")
        if self.num_prefill < 0:
            raise ValueError("--prefill must be >= 0 (0: decode workers prefill themselves)")
        if self.num_decode < 1:
            raise ValueError("--decode must be >= 1")
        if self.follow_ray_nodes and (self.ray_address is None or self.planner is not None):
            raise ValueError("--follow-ray-nodes needs --ray-address, and sizes the pools by the cluster's nodes: "
                             "not with --planner (which sizes them by starting actors)")
        if self.pipeline_across_nodes and (self.ray_address is None or self.follow_ray_nodes):
            raise ValueError("--pipeline-across-nodes needs --ray-address (nodes to spread over), "
                             "not with --follow-ray-nodes")
        if self.pipeline_across_nodes and self.pipeline_parallel_size("decode") > 1 and self.num_prefill:
            raise ValueError("--pipeline-across-nodes: decode workers whose stages run on other nodes cannot receive "
                             "a prefill worker's KV yet; give them --decode-pipeline-parallel-size 1")
        if self.planner is not None:
            for role in ("prefill", "decode"):
                count, bounds = getattr(self, f"num_{role}"), self.planner.bounds(role)
                if not bounds.min_workers <= count <= bounds.max_workers:
                    raise ValueError(f"--{role} {count} is outside the planner's --min-{role} "
                                     f"{bounds.min_workers} .. --max-{role} {bounds.max_workers}")
        check_ray_auth(self.ray_address, self.ray_auth_mode)
