"""Node loss and rejoin under `pdserve serve --ray-address`: each worker slot follows its node.

A worker actor on a joined cluster is pinned to one node (its NodeID) and listens on ports picked
free there; Ray restarts it in place while the node lives, but a node that dies never comes back
under the same NodeID, so Ray alone cannot bring that worker back. The supervisor polls every
`interval_s`. One slot per worker:

    RUNNING --(node no longer alive in ray.nodes(), or the actor dead for good)--> LOST
    LOST --(a live node that may run the pool: the restarted one)--> STARTING (a new actor there)
    STARTING --(the actor answers with its address)--> RUNNING
    STARTING --(its node dies, or the worker fails to start)--> LOST (re-placed after a pause)

A slot that becomes LOST leaves the router's pool (`Remove`); one that reaches RUNNING joins it
(`Add`). The decisions here take a `Backend` (Ray in `pdserve.cluster.RayCluster`, a fake in the
tests), so this module needs no Ray.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from typing import Any, Protocol

logger = logging.getLogger(__name__)
RETRY_AFTER_FAILED_START_S = 10.0
SUPERVISE_INTERVAL_S = 1.0
"""How often `supervise` ticks."""


class SlotState(enum.Enum):
    RUNNING = "running"
    LOST = "lost"
    STARTING = "starting"


@dataclasses.dataclass
class WorkerSlot:
    role: str
    node_id: str
    """The node the actor runs (or starts) on."""
    address: str
    """host:port the router knows the worker by ("" until a STARTING actor answers)."""
    actor: Any = None
    state: SlotState = SlotState.RUNNING
    pending: Any = None
    """STARTING: the backend's handle on the actor's start (Ray: the ref of its `address()`)."""
    not_before: float = 0.0
    """LOST: do not place before this time (after a failed start)."""
    waiting_logged: bool = False


@dataclasses.dataclass(frozen=True)
class Remove:
    role: str
    address: str


@dataclasses.dataclass(frozen=True)
class Add:
    role: str
    address: str


class Backend(Protocol):
    def nodes(self) -> list[dict]:
        """The cluster's nodes as `ray.nodes()` lists them (NodeID, Alive, NodeManagerAddress, Resources)."""

    def actor_dead(self, actor: Any) -> bool:
        """True once the actor is dead for good (no restart left); False while alive or unknown."""

    def place(self, role: str, node: dict) -> tuple[Any, Any]:
        """Start a worker actor of `role` on `node`: (actor, pending start)."""

    def started(self, pending: Any) -> str | None:
        """The worker's address once it is up, None while starting; raises if it failed."""

    def kill(self, actor: Any) -> None:
        """Kill the actor without restart (it may already be gone)."""


def eligible_nodes(nodes: list[dict], role: str, use_gpu: bool, declared_only: bool) -> list[dict]:
    """Alive nodes that may run a `role` worker: those declaring `pdserve_<role>` (all alive ones with a
    CPU when no node declares it, unless `declared_only`: the actors ask for that resource), with a GPU
    for CUDA workers."""
    alive = [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    declared = [n for n in alive if n["Resources"].get(f"pdserve_{role}", 0) > 0]
    candidates = declared if declared or declared_only else alive
    if use_gpu:
        candidates = [n for n in candidates if n["Resources"].get("GPU", 0) > 0]
    return candidates


def lost_reason(slot: WorkerSlot, alive: set[str], actor_dead: bool) -> str | None:
    """Why a RUNNING or STARTING slot has lost its worker, or None."""
    if slot.node_id not in alive:
        return f"its node {slot.node_id[:12]} is no longer alive"
    if actor_dead:
        return "its actor died (no restart left)"
    return None


def replacement_node(slot: WorkerSlot, slots: list[WorkerSlot], nodes: list[dict], use_gpu: bool,
                     declared_only: bool) -> dict | None:
    """Where to re-place a LOST slot: the eligible node running the fewest workers of its role (the
    first listed on a tie), or None while there is none."""
    others = [other for other in slots if other is not slot]
    try:
        return least_loaded_node(nodes, slot.role, others, use_gpu, declared_only)
    except RuntimeError:
        return None


def least_loaded_node(nodes: list[dict], role: str, slots: list[WorkerSlot], use_gpu: bool,
                      declared_only: bool) -> dict:
    """The eligible node running the fewest (not lost) workers of `role` among `slots`, the first listed on
    a tie; RuntimeError when no node is eligible."""
    candidates = eligible_nodes(nodes, role, use_gpu, declared_only)
    if not candidates:
        raise RuntimeError(f"no live Ray node can take a {role} worker")
    load = {n["NodeID"]: 0 for n in candidates}
    for other in slots:
        if other.role == role and other.state is not SlotState.LOST and other.node_id in load:
            load[other.node_id] += 1
    return min(candidates, key=lambda n: load[n["NodeID"]])


class NodeSupervisor:
    def __init__(self, slots: list[WorkerSlot], backend: Backend, use_gpu: bool,
                 declared_roles: set[str], follow_nodes: bool = False) -> None:
        self.slots = slots
        self.backend = backend
        self.use_gpu = use_gpu
        self.declared_roles = declared_roles
        """Roles whose actors ask for `pdserve_<role>`: only nodes declaring it can take them."""
        self.follow_nodes = follow_nodes
        """`serve --follow-ray-nodes`: a pool's size is its declaring nodes' (`pdserve_<role>: N` runs N
        workers there), so something else (the planner resizing a RayCluster's worker groups) sizes it:
        a node that joins gets its workers, and the slots of a node that is gone are dropped, not kept
        for a node that may rejoin."""

    def tick(self, now: float) -> list[Remove | Add]:
        """One poll: what the router's pool must drop and take, in order."""
        nodes = self.backend.nodes()
        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        changes: list[Remove | Add] = []
        for slot in list(self.slots):
            if slot.state is SlotState.RUNNING:
                reason = lost_reason(slot, alive, slot.node_id in alive and self.backend.actor_dead(slot.actor))
                if reason is not None:
                    logger.warning("%s worker %s lost: %s; out of rotation%s", slot.role, slot.address, reason,
                                   "" if self.follow_nodes else ", waiting for a node to re-place it")
                    changes.append(Remove(slot.role, slot.address))
                    self._lose(slot, now)
            elif slot.state is SlotState.STARTING:
                self._check_start(slot, alive, now, changes)
            if slot.state is SlotState.LOST and self.follow_nodes and slot.node_id not in alive:
                self.slots.remove(slot)  # its node is gone for good: the pool shrank
                continue
            if slot.state is SlotState.LOST and now >= slot.not_before:  # following: back on its own node
                self._place(slot, [n for n in nodes if n["NodeID"] == slot.node_id] if self.follow_nodes else nodes,
                            now)
        if self.follow_nodes:
            self._fill_new_nodes(nodes, now)
        return changes

    def _fill_new_nodes(self, nodes: list[dict], now: float) -> None:
        """A slot for each worker a declaring node has room for and does not run yet, placed there."""
        for role in sorted(self.declared_roles):
            for node in eligible_nodes(nodes, role, self.use_gpu, declared_only=True):
                room = int(node["Resources"].get(f"pdserve_{role}", 0))
                held = sum(s.role == role and s.node_id == node["NodeID"] for s in self.slots)
                for _ in range(room - held):
                    slot = WorkerSlot(role, node["NodeID"], "", state=SlotState.LOST)
                    self.slots.append(slot)
                    logger.warning("node %s joined with room for a %s worker", node["NodeID"][:12], role)
                    self._place(slot, [node], now)

    def _check_start(self, slot: WorkerSlot, alive: set[str], now: float, changes: list) -> None:
        if slot.node_id not in alive:
            logger.warning("%s worker starting on node %s lost: that node is no longer alive",
                           slot.role, slot.node_id[:12])
            self._lose(slot, now)
            return
        try:
            address = self.backend.started(slot.pending)
        except Exception as exc:  # noqa: BLE001 - the worker failed to start: retry later
            logger.warning("%s worker on node %s failed to start (%s); retrying in %.0f s", slot.role,
                           slot.node_id[:12], exc, RETRY_AFTER_FAILED_START_S)
            self._lose(slot, now + RETRY_AFTER_FAILED_START_S)
            return
        if address is not None:
            slot.address, slot.state, slot.pending = address, SlotState.RUNNING, None
            logger.warning("%s worker %s is up on node %s; back in rotation", slot.role, address, slot.node_id[:12])
            changes.append(Add(slot.role, address))

    def _lose(self, slot: WorkerSlot, not_before: float) -> None:
        if slot.actor is not None:
            self.backend.kill(slot.actor)
        slot.actor, slot.pending, slot.address = None, None, ""
        slot.state, slot.not_before, slot.waiting_logged = SlotState.LOST, not_before, False

    def _place(self, slot: WorkerSlot, nodes: list[dict], now: float) -> None:
        node = replacement_node(slot, self.slots, nodes, self.use_gpu, slot.role in self.declared_roles)
        if node is None:
            if not slot.waiting_logged:
                logger.warning("no live Ray node can take a %s worker yet%s; waiting", slot.role,
                               f" (none declares pdserve_{slot.role})" if slot.role in self.declared_roles else "")
                slot.waiting_logged = True
            return
        try:
            slot.actor, slot.pending = self.backend.place(slot.role, node)
        except Exception as exc:  # noqa: BLE001 - e.g. the node is not ready to run tasks yet
            logger.warning("cannot place a %s worker on node %s yet (%s); retrying in %.0f s", slot.role,
                           node["NodeID"][:12], exc, RETRY_AFTER_FAILED_START_S)
            slot.not_before = now + RETRY_AFTER_FAILED_START_S
            return
        slot.node_id, slot.state = node["NodeID"], SlotState.STARTING
        logger.warning("%s worker being placed on node %s (%s)", slot.role, node["NodeID"][:12],
                       node.get("NodeManagerAddress"))


def supervise(supervisor: NodeSupervisor, pool, loop: asyncio.AbstractEventLoop, running: threading.Event) -> None:
    """Thread body while `running` is set: a tick every SUPERVISE_INTERVAL_S (the backend's calls may
    block), its changes applied to the router's worker `pool` on the router's event loop."""
    while running.is_set():
        time.sleep(SUPERVISE_INTERVAL_S)
        if not running.is_set():
            return
        try:
            changes = supervisor.tick(time.monotonic())
            if changes:
                asyncio.run_coroutine_threadsafe(_apply(pool, changes), loop).result(timeout=60)
        except Exception:  # noqa: BLE001 - never let supervision die
            logger.exception("node supervision failed")


async def _apply(pool, changes: list[Remove | Add]) -> None:
    for change in changes:
        if isinstance(change, Remove):
            await pool.remove(change.address)
        else:
            await pool.add(change.address, change.role)
