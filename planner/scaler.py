"""What the planner needs from whatever runs the workers: how many there are, and a new size.

Adapters: `planner/ray_scaler.py` (worker actors of `pdserve serve --planner`, drained before
removal) and `planner/kubernetes_scaler.py` (the chart's Deployments through their `scale`
subresource, or a RayCluster's worker-group replicas).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

ROLES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class PoolReplicas:
    wanted: int
    """The size asked for (a Deployment's spec.replicas; actors started or starting)."""
    ready: int
    """Workers up and serving (ready pods; actors in the router's rotation, not draining)."""


class Scaler(Protocol):
    """Blocking calls: the planner's loop runs them in a thread."""

    def replicas(self) -> dict[str, PoolReplicas]:
        """role ("prefill", "decode") -> its current size."""

    def scale(self, role: str, replicas: int, idle_first: Sequence[str] = ()) -> None:
        """Ask for `replicas` workers of `role`. Scaling down, `idle_first` lists the pool's workers
        (host:port as the router knows them) least busy first: remove from its front when the backend
        can choose. Removal always drains: a worker stops taking requests and finishes the ones it holds
        (a pod gets SIGTERM, which drains it within its grace period)."""
