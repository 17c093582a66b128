"""Start a pipeline's other stages as Ray actors, on the nodes of the worker's placement group
(`EngineConfig.distributed_executor_backend = "ray"`, vLLM's name for the same choice).

The worker process is stage 0. Inside a placement group (pdserve serve makes one bundle per stage,
STRICT_SPREAD: one node per stage, the stage's devices on its node) stage s runs in bundle s; outside one
(a plain Ray cluster, tests) Ray places the actors where it likes. Each stage actor dials the first stage's
control listener (an authenticated `multiprocessing.connection`, the key passed through Ray) and then runs
`executor.run_rank` on that connection, as a spawned rank runs it on a pipe. The rendezvous (the TCPStore of
the stages' group) and the listener are on the first stage's node address as Ray knows it, never loopback:
the lesson of the multi-host fix (pdserve/ray_network.py).

With tensor_parallel_size N each stage is N ranks on its node: the actor is the stage's first rank (its bundle
holds the N devices) and spawns the other N-1 itself, as the worker process does for stage 0 (ranks.py).

`StageProcess` gives the executor what it needs of a spawned process (`is_alive`, `exitcode`, `join`, `kill`)
for an actor: a stage whose node is lost ends its `run` task, which the executor sees as the stage's death.
Ray is imported only here, and only when this backend is chosen.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from multiprocessing.connection import Client, Listener

logger = logging.getLogger(__name__)
ACCEPT_TIMEOUT_S = 300.0


class StageActor:
    """Body of a stage actor (wrapped by `ray.remote` in `launch`)."""

    def node_ip(self) -> str:
        import ray
        return ray.util.get_node_ip_address()

    def run(self, rank: int, world_size: int, init_method: str, config, address: tuple[str, int],
            authkey: bytes) -> None:
        from engine.parallel.ranks import run_rank
        conn = Client(address, authkey=authkey)
        conn.send_bytes(rank.to_bytes(4, "little"))
        run_rank(rank, world_size, init_method, config, conn, host=self.node_ip(), leader=True)


class StageProcess:
    """A stage actor as the executor watches it (the interface of a multiprocessing Process it uses)."""

    def __init__(self, actor, run_ref) -> None:
        self.actor = actor
        self.ref = run_ref
        self.exitcode = None

    def is_alive(self) -> bool:
        import ray
        ready, _ = ray.wait([self.ref], timeout=0)
        return not ready

    def join(self, timeout: float | None = None) -> None:
        import ray
        ray.wait([self.ref], timeout=timeout)

    def kill(self) -> None:
        import ray
        ray.kill(self.actor, no_restart=True)


def node_ip() -> str:
    """This process's node address as Ray knows it."""
    import ray
    return ray.util.get_node_ip_address()


def launch(ranks, world_size: int, init_method: str, config, host: str, use_gpu: bool) -> tuple[dict, dict]:
    """Start the first rank of each pipeline stage on another node (`ranks`: s x N for stages 1..K-1 of N
    tensor-parallel ranks) as an actor in bundle s, with the stage's N devices (it starts the stage's other ranks
    itself); returns ({rank: its connection}, {rank: its StageProcess}).
    A stage actor that dies before it connects because its node went away (Ray had not yet seen the node die
    when it placed it there) is started again, in its bundle, until it connects or ACCEPT_TIMEOUT_S passes: so a
    worker restarted after losing a stage waits for the stage's node to return. A stage that fails by itself
    (its `run` raised) fails the launch at once."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    authkey = secrets.token_bytes(32)
    listener = Listener((host, 0), authkey=authkey)
    group = get_current_placement_group()
    actor_cls = ray.remote(StageActor)

    per_stage = config.tensor_parallel_size

    def start(rank: int) -> StageProcess:
        options = {"num_cpus": 0 if use_gpu else per_stage, "num_gpus": per_stage if use_gpu else 0,
                   "max_restarts": 0}
        if group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank // per_stage)
        actor = actor_cls.options(**options).remote()
        return StageProcess(actor, actor.run.remote(rank, world_size, init_method, config, listener.address, authkey))

    try:
        procs = {rank: start(rank) for rank in ranks}
        conns = _accept(listener, procs, start)
    finally:
        listener.close()
    return conns, procs


def _accept(listener: Listener, procs: dict[int, StageProcess], start) -> dict:
    """The stages' connections by rank, as they dial in (a stage lost with its node is started again)."""
    import ray
    from ray.exceptions import RayTaskError

    conns: dict[int, object] = {}
    failure: list[BaseException] = []

    def accept() -> None:
        try:
            while len(conns) < len(procs):
                conn = listener.accept()
                conns[int.from_bytes(conn.recv_bytes(), "little")] = conn
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)

    thread = threading.Thread(target=accept, name="pdserve-stage-accept", daemon=True)
    thread.start()
    deadline = time.monotonic() + ACCEPT_TIMEOUT_S
    while len(conns) < len(procs):
        thread.join(0.2)
        for rank, proc in list(procs.items()):
            if rank in conns or proc.is_alive():
                continue
            try:
                ray.get(proc.ref)
            except RayTaskError as exc:  # the stage itself failed (its model, its device): no point retrying
                raise RuntimeError(f"pipeline stage {rank} failed before it connected: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - its actor or node is gone: start it again
                logger.warning("pipeline stage %d was lost before it connected (%s); starting it again", rank,
                               type(exc).__name__)
            procs[rank] = start(rank)
        if failure or time.monotonic() > deadline:
            detail = failure[0] if failure else f"not all within {ACCEPT_TIMEOUT_S:.0f} s"
            raise RuntimeError(f"pipeline stages on other nodes did not connect: {detail}")
    return conns
