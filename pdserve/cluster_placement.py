"""Where `pdserve serve` puts worker actors: Ray resources per actor, nodes per role, free ports.

The resources one worker actor asks for, which alive nodes may run a role, and ports chosen free on
the machine that will bind them (pure helpers), plus the probe that asks each node for them through
Ray (`probe_node_slots`, which imports Ray when called).
"""
from __future__ import annotations

import dataclasses
import socket

from pdserve.cluster_supervisor import eligible_nodes


def actor_options(role: str, use_gpu: bool, cluster_resources: dict, ranks: int = 1) -> dict:
    """Ray placement of one worker actor: a GPU per rank (tensor-parallel rank or pipeline stage) when
    workers run on CUDA (a CPU per rank otherwise), all on the actor's node, whose process starts the other
    ranks (the one-node STRICT_PACK of vLLM's executor: the ranks' KV caches are mapped by the worker
    process, and Ray hands the actor that many GPUs of one node), and the custom resource `pdserve_<role>`
    when the cluster declares it (the Helm chart's KubeRay worker groups do), so prefill actors land on
    prefill pods and decode actors on decode pods."""
    options = {"num_cpus": 1 if use_gpu else ranks, "num_gpus": ranks if use_gpu else 0}
    if f"pdserve_{role}" in cluster_resources:
        options["resources"] = {f"pdserve_{role}": 1}
    return options


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(count: int, host: str = "0.0.0.0") -> list[int]:
    """`count` distinct ports free on `host` (default: every interface) of the machine this runs on."""
    socks = [socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclasses.dataclass(frozen=True)
class NodeSlot:
    """Where a worker actor of a joined cluster runs: a node, its address as Ray knows it (the one
    routers and peers dial) and ports chosen free on that node."""

    node_id: str
    ip: str
    ports: tuple[int, ...]


def pick_nodes(nodes: list[dict], role: str, count: int, use_gpu: bool) -> list[dict]:
    """Alive nodes for `count` workers of `role`, round robin: those declaring `pdserve_<role>`
    when any does (the chart's KubeRay groups), with a GPU for CUDA workers."""
    candidates = eligible_nodes(nodes, role, use_gpu, declared_only=False)
    if not candidates:
        raise RuntimeError(f"no alive Ray node can run a {role} worker"
                           f"{' (with a GPU)' if use_gpu else ''}: {[n.get('NodeManagerAddress') for n in nodes]}")
    return [candidates[i % len(candidates)] for i in range(count)]


def probe_node_slots(nodes: list[dict], timeout_s: float = 120) -> list[NodeSlot]:
    """For each node: its address as Ray knows it and two ports free on that address (workers bind it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    probe = ray.remote(num_cpus=0)(free_ports)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(2, n["NodeManagerAddress"]) for n in nodes]
    return [NodeSlot(n["NodeID"], n["NodeManagerAddress"], tuple(ports))
            for n, ports in zip(nodes, ray.get(refs, timeout=timeout_s), strict=True)]
