"""`pdserve serve`: Ray places the workers, this process runs the router.

Ray starts a local cluster (or joins `--ray-address`), places N prefill and M
decode worker actors (one GPU each when CUDA is present) and restarts an actor
whose process dies; each actor runs an ordinary worker process body (its own
gRPC server) on a port chosen here, so a restarted worker comes back on the
same address and the router's health poll puts it back in rotation. Ray is
placement and supervision only: requests and KV never pass through it.

Joining a cluster (`--ray-address`), each actor is pinned to a node, and a node that dies never
comes back under the same NodeID: a NodeSupervisor (pdserve/cluster_supervisor.py) takes the
workers of a lost node out of the router's pool and re-places them on a node that (re)joins.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading

from common.cluster_auth import ClusterAuthConfig
from common.cluster_auth.dev_pki import make_cluster_pki
from common.cluster_auth.secret import ENV_VALUE, secret_file_for_cluster
from common.cluster_auth.tls import InternalTLSConfig
from pdserve.cluster_config import ClusterConfig
from pdserve.cluster_placement import NodeSlot, actor_options, free_port, pick_nodes, probe_node_slots
from pdserve.cluster_supervisor import NodeSupervisor, WorkerSlot, least_loaded_node, supervise
from pdserve.ray_network import init_private_ray, loopback_only_ray
from pdserve.stage_groups import bundle_actor_options, release, reserve_stage_nodes, stage_bundles
from pdserve.worker_actor import WORKER_START_TIMEOUT_S, WorkerProcess
from router.config import RouterConfig
from router.server import RouterServer, WorkersUnreachable
from worker_runtime.config import WorkerConfig

logger = logging.getLogger(__name__)
ACTOR_MAX_RESTARTS = 3
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # serve drains on them, whatever handlers `ray.init` installs
WORKER_STOP_DRAIN_S = 10.0  # workers' drain at stop, after the router's (which let the streams finish)


class RayCluster:
    """Starts and stops the worker actors; `addresses` once started. On a joined cluster `slots` records
    where each worker runs, for the NodeSupervisor (pdserve/cluster_supervisor.py)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.actors: list = []
        self.addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
        self.slots: list[WorkerSlot] = []
        self.use_gpu = False
        self.declared_roles: set[str] = set()
        self._started_ray = False
        self._lock = threading.Lock()
        self._closed = False
        self._template: WorkerConfig | None = None
        self._threads = 1
        self._resources: dict = {}
        self._actor_cls = None
        self._groups: dict = {}
        """actor -> the placement group of a worker whose pipeline stages span nodes."""
        self._probes: dict = {}
        """actor -> its outstanding liveness probe (an `address()` call)."""
        self.members: list[tuple[str, object, str]] = []
        """(role, actor, address) of the workers started with the cluster."""

    @property
    def joined(self) -> bool:
        return self.config.ray_address is not None

    def start(self) -> None:
        if not self.joined:
            loopback_only_ray()  # before Ray is imported
        import ray
        import torch

        cfg = self.config
        num_workers = cfg.num_prefill + cfg.num_decode
        num_ranks = sum(cfg.most_workers(role) * cfg.ranks(role) for role in ("prefill", "decode"))
        handlers = {sig: handler for sig in STOP_SIGNALS if (handler := signal.getsignal(sig)) is not None}
        if not ray.is_initialized():
            if cfg.ray_address:  # "auto": the cluster `ray start` runs on this machine
                ray.init(address=cfg.ray_address, logging_level=logging.WARNING, log_to_driver=True)
            else:  # a private cluster on the loopback interface, never one a `ray start` left on this machine
                init_private_ray(num_cpus=max(os.cpu_count() or 1, num_ranks))
            self._started_ray = True
        for sig, handler in handlers.items():  # ray.init's own SIGTERM handlers exit at once, with no drain
            signal.signal(sig, handler)
        # Joining a cluster, the workers run on other machines: a head without a GPU still
        # places `--device cuda` workers on GPUs, which listen on their node's address only.
        joined = self.joined
        self._resources = resources = ray.cluster_resources()
        device = cfg.worker.engine.device  # `auto`: GPUs here, or in the cluster joined
        self.use_gpu = torch.cuda.is_available() and device != "cpu" or joined and (
            device.startswith("cuda") or device == "auto" and resources.get("GPU", 0) > 0)
        self.declared_roles = {role for role in ("prefill", "decode") if f"pdserve_{role}" in resources}
        self._template = cfg.worker
        self._threads = cfg.worker.num_threads or max(1, (os.cpu_count() or 1) // num_workers)
        self._actor_cls = ray.remote(WorkerProcess)
        pending = []
        for role, count in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode)):
            if self._spread(role):  # a placement group per worker: one node per pipeline stage
                placed = [self._reserve_stages(role) for _ in range(count)]
            else:
                placed = [(slot, None) for slot in (self._node_slots(role, count, self.use_gpu) if joined
                                                    else [None] * count)]
            for slot, group in placed:
                actor = self._spawn(role, slot, group)
                self.actors.append(actor)
                if slot is not None:
                    self.slots.append(WorkerSlot(role, slot.node_id, "", actor))
                pending.append((role, actor.address.remote()))
        for i, (role, ref) in enumerate(pending):
            address = ray.get(ref, timeout=WORKER_START_TIMEOUT_S)
            self.addresses[role].append(address)
            self.members.append((role, self.actors[i], address))
            if joined:
                self.slots[i].address = address

    def _spread(self, role: str) -> bool:
        return self.config.pipeline_across_nodes and self.config.pipeline_parallel_size(role) > 1

    def _stage_bundles(self, role: str) -> list[dict]:
        return stage_bundles(role, self.config.pipeline_parallel_size(role), self.config.tensor_parallel_size(role),
                             self.use_gpu, self._resources)

    def _reserve_stages(self, role: str):
        """A worker's placement group (one node per stage) and a slot on bundle 0's node: (slot, group)."""
        import ray
        group, node_id = reserve_stage_nodes(self._stage_bundles(role))
        [slot] = probe_node_slots([n for n in ray.nodes() if n["NodeID"] == node_id])
        return slot, group

    def _spawn(self, role: str, slot: NodeSlot | None, group=None):
        """A worker actor of `role`: on this machine (`slot` None), or pinned to the slot's node (in bundle 0
        of `group`, when its pipeline stages span nodes)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        template, use_gpu = self._template, self.use_gpu
        engine = dataclasses.replace(template.engine, device="cuda" if use_gpu else template.engine.device,
                                     tensor_parallel_size=self.config.tensor_parallel_size(role),
                                     pipeline_parallel_size=self.config.pipeline_parallel_size(role),
                                     distributed_executor_backend="ray" if group is not None else "mp")
        worker = dataclasses.replace(template, role=role, num_threads=self._threads, engine=engine)
        options = actor_options(role, use_gpu, self._resources, self.config.ranks(role))
        with_metrics = self.config.router.metrics_port is not None
        if slot is None:  # this machine: ports free here, kept across actor restarts
            host = template.host
            worker = dataclasses.replace(worker, port=template.port or free_port(host),
                                         metrics_port=free_port(host) if with_metrics else None)
        else:  # another node: bound to its address as Ray knows it, ports free there, and it stays there
            host = slot.ip
            worker = dataclasses.replace(
                worker, host=host, port=template.port or slot.ports[0], advertise_host=host,
                metrics_port=slot.ports[1] if with_metrics else None,
                kv_transfer=dataclasses.replace(worker.kv_transfer, host=host, advertise_host=host))
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(slot.node_id, soft=False)
            # other machines lack our secret file: their process env gets the secret
            options["runtime_env"] = {"env_vars": {ENV_VALUE: template.auth.read_secret().decode()}}
            worker = dataclasses.replace(worker, auth=ClusterAuthConfig())
        if group is not None:  # the worker is stage 0, in the group's first bundle (on the slot's node)
            options = {**bundle_actor_options(self._stage_bundles(role)[0]), "runtime_env": options["runtime_env"],
                       "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)}
        if worker.metrics_port is not None:
            print(f"{role} worker metrics at http://{host}:{worker.metrics_port}/metrics", flush=True)
        actor = self._actor_cls.options(**options, max_restarts=ACTOR_MAX_RESTARTS, max_task_retries=0,
                                        name=None).remote(worker, self.config.log_level)
        if group is not None:
            self._groups[actor] = group
        return actor

    @staticmethod
    def _node_slots(role: str, count: int, use_gpu: bool) -> list[NodeSlot]:
        """Nodes for `count` workers of `role`, with two ports each picked free on the node itself."""
        import ray
        return probe_node_slots(pick_nodes(ray.nodes(), role, count, use_gpu))

    # ---- the NodeSupervisor's backend (joined clusters) ---------------------
    def nodes(self) -> list[dict]:
        import ray
        return ray.nodes()

    def actor_dead(self, actor) -> bool:
        """Polls one `address()` call per actor at a time: an ActorDiedError means dead for good (a
        restarting actor's call waits for the restart)."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnschedulableError
        probe = self._probes.get(actor)
        if probe is None:
            self._probes[actor] = actor.address.remote()
            return False
        ready, _ = ray.wait([probe], timeout=0)
        if not ready:
            return False
        del self._probes[actor]
        try:
            ray.get(probe)
        except (ActorDiedError, ActorUnschedulableError):
            return True
        except Exception:  # noqa: BLE001 - the worker reported a start error: Ray restarts it if it can
            return False
        return False

    def spawn(self, role: str):
        """One more worker actor of `role` (the planner's scale-up): on this machine, or on the eligible
        node of a joined cluster running the fewest workers of that role. Returns (actor, its slot or None)."""
        if not self.joined:
            with self._lock:
                if self._closed:
                    raise RuntimeError("serve is stopping")
                actor = self._spawn(role, None)
                self.actors.append(actor)
            return actor, None
        node = least_loaded_node(self.nodes(), role, self.slots, self.use_gpu, role in self.declared_roles)
        actor, _ = self.place(role, node)
        return actor, WorkerSlot(role, node["NodeID"], "", actor)

    def wait_started(self, actor, timeout_s: float) -> str:
        """The worker's address once it serves; raises if it failed to start or was killed."""
        import ray
        return ray.get(actor.address.remote(), timeout=timeout_s)

    def drain(self, actor, timeout_s: float) -> None:
        """Let the worker finish what it holds (new requests refused), then stop serving."""
        import ray
        ray.get(actor.drain.remote(timeout_s), timeout=timeout_s + 120)

    def place(self, role: str, node: dict):
        """A worker of `role` on `node` (one whose stages span nodes: wherever its placement group lands)."""
        slot, group = self._reserve_stages(role) if self._spread(role) else (probe_node_slots([node], 60)[0], None)
        with self._lock:
            if self._closed:
                raise RuntimeError("serve is stopping")
            actor = self._spawn(role, slot, group)
            self.actors.append(actor)
        return actor, actor.address.remote()

    def started(self, pending) -> str | None:
        import ray
        ready, _ = ray.wait([pending], timeout=0)
        return ray.get(pending) if ready else None

    def kill(self, actor) -> None:
        import ray
        self._probes.pop(actor, None)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        with self._lock:
            if actor in self.actors:
                self.actors.remove(actor)
            group = self._groups.pop(actor, None)
        if group is not None:
            release(group)

    def stop(self) -> None:
        import ray
        with self._lock:
            self._closed = True
            actors, self.actors = self.actors, []
        if actors:  # drained side by side, then killed (a worker that does not answer in time is killed anyway)
            ray.wait([actor.drain.remote(WORKER_STOP_DRAIN_S) for actor in actors], num_returns=len(actors),
                     timeout=WORKER_STOP_DRAIN_S + 15)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        for group in self._groups.values():
            release(group)
        if self._started_ray:
            ray.shutdown()


def supervisor_for(cluster: RayCluster) -> NodeSupervisor:
    """The node supervisor of a joined cluster's worker slots, with the cluster as its Ray backend."""
    return NodeSupervisor(cluster.slots, cluster, cluster.use_gpu, cluster.declared_roles,
                          cluster.config.follow_ray_nodes)


def run_serve(config: ClusterConfig) -> int:
    """Start the workers under Ray and the router here; stop everything on SIGINT/SIGTERM.

    Every internal link is authenticated: without a configured cluster secret a throwaway one is
    written (mode 0600) to a private temporary directory, removed on exit. With `internal_tls` a
    throwaway CA and certificates for the workers and the router go there too."""
    secret_dir = tempfile.mkdtemp(prefix="pdserve-secret-")
    auth = ClusterAuthConfig(secret_file_for_cluster(config.router.cluster_auth, secret_dir))
    router, worker = config.router, config.worker
    if config.internal_tls:
        pki = make_cluster_pki(secret_dir)
        worker = dataclasses.replace(worker, tls=InternalTLSConfig(pki["worker"].cert, pki["worker"].key,
                                                                   pki["worker"].ca))
        router = dataclasses.replace(router, worker_tls=InternalTLSConfig(pki["router"].cert, pki["router"].key,
                                                                          pki["router"].ca))
    config = dataclasses.replace(config, internal_tls=False,  # made: from here on, the files are the config
                                 router=dataclasses.replace(router, cluster_auth=auth),
                                 worker=dataclasses.replace(worker, auth=auth))
    cluster = RayCluster(config)
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()

    for sig in STOP_SIGNALS:  # RayCluster.start keeps them so across ray.init
        signal.signal(sig, on_signal)
    try:
        cluster.start()
        if stop.is_set():
            return 0
        router_config = dataclasses.replace(config.router, prefill_workers=cluster.addresses["prefill"],
                                            decode_workers=cluster.addresses["decode"])
        try:
            return asyncio.run(_serve_router(router_config, stop, config, cluster))
        except WorkersUnreachable as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
    finally:
        cluster.stop()
        shutil.rmtree(secret_dir, ignore_errors=True)


async def _serve_router(router_config: RouterConfig, stop: threading.Event, config: ClusterConfig,
                        cluster: RayCluster | None = None) -> int:
    router = RouterServer(router_config)
    address = await router.start(wait_for_workers_s=60.0)
    extras = ""
    if router.http_port is not None:
        scheme = "https" if router_config.security.tls else "http"
        extras += f", OpenAI API at {scheme}://{router_config.host}:{router.http_port}/v1"
    if router_config.metrics_port is not None:
        extras += f", metrics at http://{router_config.host}:{router_config.metrics_port}/metrics"
    workers = ", ".join([*(f"prefill {a}" for a in router_config.prefill_workers),
                         *(f"decode {a}" for a in router_config.decode_workers)])
    how = "authenticated with the cluster secret" + (", mutual TLS" if router_config.worker_tls.enabled else "")
    print(f"workers: {workers} (internal links {how})", flush=True)
    print(f"ready: pdserve serving at {address} ({config.num_prefill} prefill, {config.num_decode} decode"
          f"{extras})", flush=True)
    supervising = threading.Event()
    thread = None
    if cluster is not None and cluster.joined:  # a private cluster: Ray restarts actors in place
        supervising.set()
        thread = threading.Thread(target=supervise, args=(supervisor_for(cluster), router.pool,
                                                             asyncio.get_running_loop(), supervising),
                                  name="node-supervisor", daemon=True)
        thread.start()
    planner = None
    if cluster is not None and config.planner is not None:
        from planner.serve_planner import ServePlanner
        planner = ServePlanner(config.planner, cluster, router, config.worker.drain_timeout_s)
        planner.start()
    try:
        while not stop.is_set():
            await asyncio.sleep(0.1)
    finally:
        supervising.clear()
        if planner is not None:
            await planner.stop()
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 10.0)
    await router.drain()
    await router.stop()
    return 0
