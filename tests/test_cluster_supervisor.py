"""The NodeSupervisor's decisions (pdserve/cluster_supervisor.py) against a fake cluster, no Ray:
which slots are lost, when the router's pool drops and takes them, where they are re-placed."""
from __future__ import annotations

import pytest

from pdserve.cluster_supervisor import (
    RETRY_AFTER_FAILED_START_S,
    Add,
    NodeSupervisor,
    Remove,
    SlotState,
    WorkerSlot,
    eligible_nodes,
    lost_reason,
    replacement_node,
)


def _node(node_id: str, ip: str, alive: bool = True, **resources) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive, "Resources": {"CPU": 2.0, **resources}}


class FakeCluster:
    """The Backend a NodeSupervisor drives, as plain data: nodes, actors, starts."""

    def __init__(self, nodes: list[dict]) -> None:
        self.node_list = nodes
        self.dead: set[str] = set()
        self.killed: list[str] = []
        self.placed: list[tuple[str, str]] = []
        self.ready: dict[str, str | Exception] = {}
        """pending start -> the address it answers (or its error); absent: still starting."""

    def nodes(self) -> list[dict]:
        return self.node_list

    def actor_dead(self, actor: str) -> bool:
        return actor in self.dead

    def place(self, role: str, node: dict) -> tuple[str, str]:
        self.placed.append((role, node["NodeManagerAddress"]))
        actor = f"{role}-actor-{len(self.placed)}"
        return actor, f"start-{actor}"

    def started(self, pending: str) -> str | None:
        result = self.ready.get(pending)
        if isinstance(result, Exception):
            raise result
        return result

    def kill(self, actor: str) -> None:
        self.killed.append(actor)


def _cluster() -> tuple[FakeCluster, NodeSupervisor]:
    nodes = [_node("head", "10.0.0.1"), _node("p1", "10.0.0.2", pdserve_prefill=4.0),
             _node("d1", "10.0.0.3", pdserve_decode=4.0)]
    slots = [WorkerSlot("prefill", "p1", "10.0.0.2:5001", "prefill-actor-0"),
             WorkerSlot("decode", "d1", "10.0.0.3:5002", "decode-actor-0")]
    fake = FakeCluster(nodes)
    return fake, NodeSupervisor(slots, fake, use_gpu=False, declared_roles={"prefill", "decode"})


def test_a_lost_node_takes_its_worker_out_and_a_rejoined_node_gets_a_new_one():
    fake, supervisor = _cluster()
    prefill, decode = supervisor.slots
    # 1. all alive: nothing changes, nothing is placed
    assert supervisor.tick(0.0) == [] and fake.placed == []
    # 2. the decode node dies: its worker leaves the pool, its actor is killed, the slot waits
    fake.node_list[2] = _node("d1", "10.0.0.3", alive=False, pdserve_decode=4.0)
    assert supervisor.tick(1.0) == [Remove("decode", "10.0.0.3:5002")]
    assert fake.killed == ["decode-actor-0"] and decode.state is SlotState.LOST and decode.address == ""
    # 3. no node declares the decode pool: it waits (never falls back onto the head or the prefill node)
    assert supervisor.tick(2.0) == [] and fake.placed == [] and decode.state is SlotState.LOST
    # 4. the node restarts under a new NodeID at the same address: a new actor is placed there
    fake.node_list.append(_node("d1-again", "10.0.0.3", pdserve_decode=4.0))
    assert supervisor.tick(3.0) == []
    assert fake.placed == [("decode", "10.0.0.3")]
    assert decode.state is SlotState.STARTING and decode.node_id == "d1-again"
    # 5. while it loads nothing joins the pool; once it answers, its (new) address does
    assert supervisor.tick(4.0) == []
    fake.ready["start-decode-actor-1"] = "10.0.0.3:6002"
    assert supervisor.tick(5.0) == [Add("decode", "10.0.0.3:6002")]
    assert decode.state is SlotState.RUNNING and decode.address == "10.0.0.3:6002"
    # 6. leak check: one actor per slot, nothing pending, the prefill slot never touched
    assert supervisor.tick(6.0) == [] and fake.placed == [("decode", "10.0.0.3")]
    assert prefill.state is SlotState.RUNNING and prefill.actor == "prefill-actor-0"
    assert all(s.pending is None for s in supervisor.slots)


def test_an_actor_dead_for_good_on_a_live_node_is_replaced():
    fake, supervisor = _cluster()
    fake.dead.add("prefill-actor-0")
    assert supervisor.tick(0.0) == [Remove("prefill", "10.0.0.2:5001")]
    assert fake.killed == ["prefill-actor-0"] and fake.placed == [("prefill", "10.0.0.2")]
    fake.ready["start-prefill-actor-1"] = "10.0.0.2:7001"
    assert supervisor.tick(1.0) == [Add("prefill", "10.0.0.2:7001")]


def test_a_failed_start_is_retried_after_a_pause_and_a_node_lost_while_starting_is_waited_for():
    fake, supervisor = _cluster()
    decode = supervisor.slots[1]
    fake.dead.add("decode-actor-0")
    supervisor.tick(0.0)
    fake.ready["start-decode-actor-1"] = RuntimeError("worker failed to start")
    assert supervisor.tick(1.0) == [] and decode.state is SlotState.LOST
    assert fake.killed == ["decode-actor-0", "decode-actor-1"]
    supervisor.tick(1.0 + RETRY_AFTER_FAILED_START_S / 2)
    assert len(fake.placed) == 1  # not yet
    supervisor.tick(1.0 + RETRY_AFTER_FAILED_START_S)
    assert len(fake.placed) == 2 and decode.state is SlotState.STARTING
    fake.node_list[2] = _node("d1", "10.0.0.3", alive=False, pdserve_decode=4.0)
    assert supervisor.tick(20.0) == [] and decode.state is SlotState.LOST
    assert fake.killed[-1] == "decode-actor-2" and len(fake.placed) == 2


def test_a_placement_that_raises_is_retried_later():
    fake, supervisor = _cluster()

    def refuse(role, node):
        raise TimeoutError("node not ready")
    fake.place = refuse
    fake.dead.add("decode-actor-0")
    assert supervisor.tick(0.0) == [Remove("decode", "10.0.0.3:5002")]
    assert supervisor.slots[1].state is SlotState.LOST
    assert supervisor.slots[1].not_before == RETRY_AFTER_FAILED_START_S


def test_replacement_spreads_over_the_nodes_of_the_pool():
    nodes = [_node("a", "10.0.0.1", pdserve_decode=2.0), _node("b", "10.0.0.2", pdserve_decode=2.0),
             _node("c", "10.0.0.3", alive=False, pdserve_decode=2.0)]
    slots = [WorkerSlot("decode", "a", "10.0.0.1:1"), WorkerSlot("decode", "a", "10.0.0.1:2"),
             WorkerSlot("decode", "c", "", state=SlotState.LOST), WorkerSlot("prefill", "b", "10.0.0.2:3")]
    assert replacement_node(slots[2], slots, nodes, False, True)["NodeID"] == "b"
    assert replacement_node(slots[2], slots[2:], nodes, False, True)["NodeID"] == "a"  # tie: first listed


@pytest.mark.parametrize(("declared_only", "want"), [(True, []), (False, ["head", "p1"])])
def test_a_pool_that_asks_for_its_resource_only_goes_where_it_is_declared(declared_only, want):
    nodes = [_node("head", "10.0.0.1"), _node("p1", "10.0.0.2", pdserve_prefill=4.0),
             _node("d1", "10.0.0.3", alive=False, pdserve_decode=4.0)]
    assert [n["NodeID"] for n in eligible_nodes(nodes, "decode", False, declared_only)] == want
    assert eligible_nodes(nodes, "decode", True, False) == []  # CUDA workers need a GPU node


def test_lost_reason():
    slot = WorkerSlot("decode", "d1", "10.0.0.3:1")
    assert lost_reason(slot, {"d1"}, False) is None
    assert "no longer alive" in lost_reason(slot, {"d2"}, False)
    assert "died" in lost_reason(slot, {"d1"}, True)


def test_supervise_applies_each_ticks_changes_to_the_pool_on_its_loop(monkeypatch):
    """The thread body: ticks until stopped, each tick's Remove/Add applied in order on the router's loop;
    a tick that raises is logged and supervision goes on."""
    import asyncio
    import threading

    from pdserve import cluster_supervisor

    monkeypatch.setattr(cluster_supervisor, "SUPERVISE_INTERVAL_S", 0.01)
    running = threading.Event()
    running.set()
    ticks = iter([[Remove("decode", "10.0.0.3:1")], RuntimeError("ray hiccup"), [Add("decode", "10.0.0.3:2")]])

    class Supervisor:
        def tick(self, now):
            step = next(ticks, [])
            if isinstance(step, Exception):
                raise step
            if not step:
                running.clear()
            return step

    class Pool:
        def __init__(self):
            self.calls, self.threads = [], set()

        async def remove(self, address):
            self.calls.append(("remove", address))
            self.threads.add(threading.get_ident())

        async def add(self, address, role):
            self.calls.append(("add", address, role))
            self.threads.add(threading.get_ident())

    async def main(pool):
        thread = threading.Thread(target=cluster_supervisor.supervise,
                                  args=(Supervisor(), pool, asyncio.get_running_loop(), running))
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.01)
        return threading.get_ident()

    pool = Pool()
    loop_thread = asyncio.run(main(pool))
    assert pool.calls == [("remove", "10.0.0.3:1"), ("add", "10.0.0.3:2", "decode")]
    assert pool.threads == {loop_thread}  # applied on the router's loop, not the supervisor's thread


def test_following_nodes_a_new_pod_gets_its_worker_and_a_deleted_one_leaves_the_pool():
    """`serve --follow-ray-nodes` (a RayCluster the planner resizes): the pool is what the declaring
    nodes hold, one worker per unit of `pdserve_<role>`."""
    nodes = [_node("head", "10.0.0.1"), _node("p1", "10.0.0.2", pdserve_prefill=1.0),
             _node("d1", "10.0.0.3", pdserve_decode=1.0)]
    slots = [WorkerSlot("prefill", "p1", "10.0.0.2:5001", "prefill-actor-0"),
             WorkerSlot("decode", "d1", "10.0.0.3:5002", "decode-actor-0")]
    fake = FakeCluster(nodes)
    supervisor = NodeSupervisor(slots, fake, use_gpu=False, declared_roles={"prefill", "decode"}, follow_nodes=True)
    assert supervisor.tick(0.0) == [] and fake.placed == []  # every node full: nothing to do
    # the planner grew the decode group: the new pod joins, a worker starts there and joins the pool
    fake.node_list.append(_node("d2", "10.0.0.4", pdserve_decode=1.0))
    assert supervisor.tick(1.0) == [] and fake.placed == [("decode", "10.0.0.4")]
    assert supervisor.tick(2.0) == [] and len(supervisor.slots) == 3  # placed once, not again while it starts
    fake.ready["start-decode-actor-1"] = "10.0.0.4:6002"
    assert supervisor.tick(3.0) == [Add("decode", "10.0.0.4:6002")]
    # the planner shrank it (KubeRay deleted the pod): the worker leaves the pool and its slot is dropped
    fake.node_list[2] = _node("d1", "10.0.0.3", alive=False, pdserve_decode=1.0)
    assert supervisor.tick(4.0) == [Remove("decode", "10.0.0.3:5002")]
    assert [s.node_id for s in supervisor.slots] == ["p1", "d2"]
    assert supervisor.tick(5.0) == [] and fake.placed == [("decode", "10.0.0.4")]  # nothing waits to come back
    # an actor dead for good on a live node is re-placed on that same node
    fake.dead.add("prefill-actor-0")
    assert supervisor.tick(6.0) == [Remove("prefill", "10.0.0.2:5001")]
    assert fake.placed[-1] == ("prefill", "10.0.0.2")

