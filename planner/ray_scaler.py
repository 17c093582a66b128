"""The planner's Scaler over `pdserve serve`'s Ray worker actors (planner/scaler.py).

Scale-up starts an actor (on this machine, or on the least loaded eligible node of a joined
cluster) and adds its worker to the router's pool once it answers. Scale-down never cuts work:
the worker leaves the router's rotation first (no new request reaches it), then drains (it
finishes what it holds, prefill leases included, within `drain_timeout_s`), and only then is
it removed from the pool and its actor killed. A worker still starting is cancelled first.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
from collections.abc import Sequence
from typing import Any

from planner.scaler import ROLES, PoolReplicas

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 900.0


class MemberState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"


@dataclasses.dataclass(eq=False)
class Member:
    role: str
    actor: Any
    address: str = ""
    state: MemberState = MemberState.STARTING
    slot: Any = None
    """Joined clusters: its NodeSupervisor slot."""


class RayScaler:
    def __init__(self, cluster, pool, loop: asyncio.AbstractEventLoop, drain_timeout_s: float) -> None:
        """`cluster`: a started pdserve.cluster.RayCluster (spawn, wait_started, drain, kill, members,
        slots); `pool`: the router's WorkerPool, whose event loop is `loop` (the scaler's calls come
        from the planner's thread)."""
        self.cluster = cluster
        self.pool = pool
        self.loop = loop
        self.drain_timeout_s = drain_timeout_s
        self.members = [Member(role, actor, address, MemberState.RUNNING,
                               _slot_of(cluster, actor)) for role, actor, address in cluster.members]
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def replicas(self) -> dict[str, PoolReplicas]:
        with self._lock:
            wanted = {role: sum(m.role == role and m.state is not MemberState.DRAINING for m in self.members)
                      for role in ROLES}
        ready = {role: len(self.pool.healthy(role)) for role in ROLES}
        return {role: PoolReplicas(wanted[role], ready[role]) for role in ROLES}

    def alive(self, role: str) -> int:
        """Actors of `role` holding resources: starting, running or draining."""
        with self._lock:
            return sum(m.role == role for m in self.members)

    def scale(self, role: str, replicas: int, idle_first: Sequence[str] = ()) -> None:
        with self._lock:
            active = [m for m in self.members if m.role == role and m.state is not MemberState.DRAINING]
            if replicas > len(active):
                for _ in range(replicas - len(active)):
                    actor, slot = self.cluster.spawn(role)
                    member = Member(role, actor, slot=slot)
                    self.members.append(member)
                    self._background(self._start, member)
            rank = {address: i for i, address in enumerate(idle_first)}
            victims = sorted(active, key=lambda m: (m.state is not MemberState.STARTING,
                                                    rank.get(m.address, len(rank))))
            for member in victims[:max(0, len(active) - replicas)]:
                member.state = MemberState.DRAINING
                self._background(self._remove, member)

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the starts and drains under way (serve is stopping)."""
        for thread in list(self._threads):
            thread.join(timeout_s)

    # ---- background work ----------------------------------------------------
    def _background(self, target, member: Member) -> None:
        thread = threading.Thread(target=target, args=(member,), name=f"planner-{member.role}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _on_loop(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _start(self, member: Member) -> None:
        try:
            address = self.cluster.wait_started(member.actor, START_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - it failed to start, or was cancelled by a scale-down
            if member.state is not MemberState.DRAINING:
                logger.warning("planner: a new %s worker failed to start: %s", member.role, exc)
            self._forget(member)
            return
        with self._lock:
            member.address = address
            cancelled = member.state is MemberState.DRAINING
            if not cancelled:
                member.state = MemberState.RUNNING
        if cancelled:  # scaled down while it started: drain it now
            self._remove(member)
            return
        if member.slot is not None:
            member.slot.address = address
            self.cluster.slots.append(member.slot)
        self._on_loop(self.pool.add(address, member.role))
        logger.warning("planner: %s worker %s added", member.role, address)

    def _remove(self, member: Member) -> None:
        if not member.address:  # still starting: cancelled (its _start then forgets it)
            self.cluster.kill(member.actor)
            return
        address = member.address
        self._on_loop(self._retire(address))
        try:
            self.cluster.drain(member.actor, self.drain_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a dead worker has nothing left to drain
            logger.warning("planner: %s worker %s did not drain cleanly: %s", member.role, address, exc)
        self._on_loop(self.pool.remove(address))
        if member.slot is not None and member.slot in self.cluster.slots:
            self.cluster.slots.remove(member.slot)
        self.cluster.kill(member.actor)
        self._forget(member)
        logger.warning("planner: %s worker %s drained and removed", member.role, address)

    async def _retire(self, address: str) -> None:
        self.pool.retire(address)

    def _forget(self, member: Member) -> None:
        with self._lock:
            if member in self.members:
                self.members.remove(member)


def _slot_of(cluster, actor):
    return next((slot for slot in cluster.slots if slot.actor is actor), None)
