"""The planner's Ray adapter over a fake cluster and a fake router pool: scale-up adds a worker to the
pool once it answers; scale-down takes it out of rotation first, drains it, and only then removes it
from the pool and kills its actor; a worker still starting is cancelled before a serving one."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from planner.ray_scaler import RayScaler
from planner.scaler import PoolReplicas


class FakeCluster:
    def __init__(self, events: list) -> None:
        self.events = events
        self.members = [("prefill", "actor-p0", "10.0.0.1:1"), ("decode", "actor-d0", "10.0.0.2:1"),
                        ("decode", "actor-d1", "10.0.0.3:1")]
        self.slots: list = []
        self.started: dict[str, threading.Event] = {}
        self.killed: set[str] = set()
        self._count = 0

    def spawn(self, role: str):
        self._count += 1
        actor = f"actor-new{self._count}"
        self.started[actor] = threading.Event()
        self.events.append(("spawn", role, actor))
        return actor, None

    def wait_started(self, actor: str, timeout_s: float) -> str:
        assert self.started[actor].wait(10)
        if actor in self.killed:
            raise RuntimeError("the actor was killed")
        return f"10.0.1.{actor[-1]}:1"

    def drain(self, actor: str, timeout_s: float) -> None:
        self.events.append(("drain", actor))

    def kill(self, actor: str) -> None:
        self.killed.add(actor)
        self.events.append(("kill", actor))
        if actor in self.started:
            self.started[actor].set()


class FakePool:
    def __init__(self, events: list, addresses: dict[str, str]) -> None:
        self.events = events
        self.rotation = dict(addresses)  # address -> role

    def healthy(self, role: str) -> list[str]:
        return [a for a, r in self.rotation.items() if r == role]

    async def add(self, address: str, role: str) -> None:
        self.rotation[address] = role
        self.events.append(("add", address))

    def retire(self, address: str) -> None:
        self.rotation.pop(address, None)
        self.events.append(("retire", address))

    async def remove(self, address: str) -> None:
        self.events.append(("remove", address))


@pytest.fixture
def setup():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    events: list = []
    cluster = FakeCluster(events)
    pool = FakePool(events, {a: r for r, _, a in cluster.members})
    scaler = RayScaler(cluster, pool, loop, drain_timeout_s=5.0)
    yield scaler, cluster, pool, events
    scaler.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_scale_up_adds_the_worker_once_it_answers(setup):
    scaler, cluster, pool, events = setup
    assert scaler.replicas() == {"prefill": PoolReplicas(1, 1), "decode": PoolReplicas(2, 2)}
    scaler.scale("prefill", 2)
    assert scaler.replicas()["prefill"] == PoolReplicas(2, 1)  # asked for, not up yet
    assert not any(e[0] == "add" for e in events)
    cluster.started["actor-new1"].set()
    wait_for(lambda: ("add", "10.0.1.1:1") in events)
    assert scaler.replicas()["prefill"] == PoolReplicas(2, 2)


def test_scale_down_retires_then_drains_then_removes_the_idlest(setup):
    scaler, cluster, pool, events = setup
    scaler.scale("decode", 1, idle_first=["10.0.0.3:1", "10.0.0.2:1"])
    assert scaler.replicas()["decode"].wanted == 1
    wait_for(lambda: ("kill", "actor-d1") in events)
    mine = [e for e in events if e[-1] in ("10.0.0.3:1", "actor-d1")]
    assert mine == [("retire", "10.0.0.3:1"), ("drain", "actor-d1"), ("remove", "10.0.0.3:1"), ("kill", "actor-d1")]
    assert "actor-d0" not in cluster.killed
    wait_for(lambda: scaler.alive("decode") == 1)


def test_a_worker_still_starting_is_cancelled_first(setup):
    scaler, cluster, pool, events = setup
    scaler.scale("prefill", 2)
    scaler.scale("prefill", 1, idle_first=["10.0.0.1:1"])
    wait_for(lambda: scaler.alive("prefill") == 1)
    assert "actor-new1" in cluster.killed and "actor-p0" not in cluster.killed
    assert not any(e[0] in ("retire", "drain", "add") for e in events)
    assert scaler.replicas()["prefill"] == PoolReplicas(1, 1)


def test_a_start_that_fails_is_forgotten(setup):
    scaler, cluster, pool, events = setup
    scaler.scale("decode", 3)
    cluster.killed.add("actor-new1")  # it died while starting
    cluster.started["actor-new1"].set()
    wait_for(lambda: scaler.alive("decode") == 2)
    assert scaler.replicas()["decode"] == PoolReplicas(2, 2)
