"""Where `pdserve serve` asks Ray to put worker actors."""
from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.cluster_placement import actor_options, free_ports, pick_nodes


def test_local_cluster_needs_nothing_but_a_cpu():
    assert actor_options("prefill", False, {"CPU": 2.0}) == {"num_cpus": 1, "num_gpus": 0}


def test_roles_follow_the_worker_groups_that_declare_them():
    kuberay = {"CPU": 24.0, "GPU": 6.0, "pdserve_prefill": 2.0, "pdserve_decode": 4.0}
    assert actor_options("prefill", True, kuberay) == {"num_cpus": 1, "num_gpus": 1,
                                                       "resources": {"pdserve_prefill": 1}}
    assert actor_options("decode", True, kuberay)["resources"] == {"pdserve_decode": 1}


def test_a_tensor_parallel_worker_asks_for_a_device_per_rank_on_one_node():
    assert actor_options("decode", True, {"GPU": 8.0}, ranks=4) == {"num_cpus": 1, "num_gpus": 4}
    assert actor_options("prefill", False, {"CPU": 8.0}, ranks=2) == {"num_cpus": 2, "num_gpus": 0}


def test_serve_sizes_prefill_and_decode_ranks_separately():
    from engine.config import EngineConfig
    from pdserve.cluster import ClusterConfig
    from router.config import RouterConfig
    from worker_runtime.config import WorkerConfig
    worker = WorkerConfig(role="decode", engine=EngineConfig(tensor_parallel_size=2))
    config = ClusterConfig(router=RouterConfig(), worker=worker, decode_tensor_parallel_size=4)
    assert (config.tensor_parallel_size("prefill"), config.tensor_parallel_size("decode")) == (2, 4)
    with pytest.raises(ValueError, match="--prefill-tensor-parallel-size must be >= 1"):
        ClusterConfig(router=RouterConfig(), worker=worker, prefill_tensor_parallel_size=0)
    # pipeline stages likewise, and a worker's Ray resources count its ranks times its stages
    config = ClusterConfig(router=RouterConfig(), worker=WorkerConfig(role="decode"), prefill_pipeline_parallel_size=3)
    assert (config.pipeline_parallel_size("prefill"), config.ranks("prefill"), config.ranks("decode")) == (3, 3, 1)
    with pytest.raises(ValueError, match="--decode-pipeline-parallel-size must be >= 1"):
        ClusterConfig(router=RouterConfig(), worker=worker, decode_pipeline_parallel_size=0)
    config = ClusterConfig(router=RouterConfig(), worker=worker, decode_pipeline_parallel_size=2)
    assert config.ranks("decode") == 4  # 2 stages of 2 tensor-parallel ranks


def test_serve_flags_of_the_planner_and_node_following_are_checked():
    from pdserve.cluster import ClusterConfig
    from planner.config import PlannerConfig
    from router.config import RouterConfig
    from worker_runtime.config import WorkerConfig
    worker = WorkerConfig(role="decode")
    with pytest.raises(ValueError, match="--follow-ray-nodes needs --ray-address"):
        ClusterConfig(RouterConfig(), worker, follow_ray_nodes=True)
    with pytest.raises(ValueError, match="not with --planner"):
        ClusterConfig(RouterConfig(), worker, ray_address="auto", follow_ray_nodes=True, planner=PlannerConfig())
    with pytest.raises(ValueError, match="--decode 5 is outside the planner's --min-decode 1 .. --max-decode 4"):
        ClusterConfig(RouterConfig(), worker, num_decode=5, planner=PlannerConfig())
    # a private Ray cluster is sized for the planner's largest pools, so a scale-up never waits for a CPU
    config = ClusterConfig(RouterConfig(), worker, planner=PlannerConfig(max_prefill=3, max_decode=2))
    assert (config.most_workers("prefill"), config.most_workers("decode")) == (3, 2)
    assert ClusterConfig(RouterConfig(), worker, num_prefill=2).most_workers("prefill") == 2


def _node(ip: str, alive: bool = True, **resources) -> dict:
    return {"NodeID": f"id-{ip}", "NodeManagerAddress": ip, "Alive": alive, "Resources": {"CPU": 4.0, **resources}}


def test_joined_workers_go_to_nodes_declaring_their_pool_round_robin():
    nodes = [_node("10.0.0.1"), _node("10.0.0.2", pdserve_prefill=1.0),
             _node("10.0.0.3", pdserve_decode=2.0), _node("10.0.0.4", pdserve_decode=2.0),
             _node("10.0.0.5", alive=False, pdserve_decode=2.0)]
    assert [n["NodeManagerAddress"] for n in pick_nodes(nodes, "prefill", 2, False)] == ["10.0.0.2"] * 2
    assert [n["NodeManagerAddress"] for n in pick_nodes(nodes, "decode", 3, False)] == \
        ["10.0.0.3", "10.0.0.4", "10.0.0.3"]  # the dead node is never picked
    plain = [_node("10.0.0.1"), _node("10.0.0.2", GPU=1.0)]
    assert [n["NodeManagerAddress"] for n in pick_nodes(plain, "decode", 2, False)] == ["10.0.0.1", "10.0.0.2"]
    assert [n["NodeManagerAddress"] for n in pick_nodes(plain, "decode", 2, True)] == ["10.0.0.2"] * 2
    with pytest.raises(RuntimeError, match="no alive Ray node can run a prefill worker \\(with a GPU\\)"):
        pick_nodes([_node("10.0.0.1")], "prefill", 1, True)


def test_free_ports_are_distinct_and_bindable_on_every_interface():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))


def test_a_router_that_cannot_reach_its_workers_does_not_say_ready(smollm2_dir):
    from router.config import RouterConfig
    from router.server import RouterServer, WorkersUnreachable
    nobody = f"127.0.0.1:{free_ports(1)[0]}"
    router = RouterServer(RouterConfig(model=str(smollm2_dir), prefill_workers=[nobody], decode_workers=[nobody]))
    with pytest.raises(WorkersUnreachable, match=f"workers not healthy .*{nobody}"):
        asyncio.run(router.start(wait_for_workers_s=1.0))
