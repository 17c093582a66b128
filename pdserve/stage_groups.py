"""Workers whose pipeline stages span nodes (`pdserve serve --pipeline-across-nodes`): a Ray placement group each.

A worker of K stages gets a placement group of K bundles, STRICT_SPREAD (one node per stage, as vLLM places a
multi-node pipeline): each bundle holds one stage's devices (its tensor-parallel ranks stay on one node) and,
when the cluster declares the role's resource (the chart's KubeRay groups do), one unit of it, so stages land
on the role's nodes. The worker actor (stage 0) runs in bundle 0 and starts the other stages as actors in
bundles 1..K-1 (engine/parallel/ray_stages.py). When a stage's node is lost, Ray reschedules that bundle once a
node can hold it again; the worker, which exits when a stage is gone (worker_runtime/server.py), is restarted
by Ray in bundle 0 and waits there for its stages: the worker is re-placed as the node returns.
"""
from __future__ import annotations

STAGE_GROUP_TIMEOUT_S = 300.0


def stage_bundles(role: str, stages: int, ranks_per_stage: int, use_gpu: bool, cluster_resources: dict) -> list[dict]:
    """The bundles of one worker's placement group: one per stage."""
    bundle: dict[str, float] = {"CPU": 1 if use_gpu else ranks_per_stage}  # a core per rank on CPU
    if use_gpu:
        bundle["GPU"] = ranks_per_stage
    if f"pdserve_{role}" in cluster_resources:
        bundle[f"pdserve_{role}"] = 1
    return [dict(bundle) for _ in range(stages)]


def bundle_actor_options(bundle: dict) -> dict:
    """Options of the worker actor that runs in `bundle` (it takes the whole bundle)."""
    options = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)}
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    if custom:
        options["resources"] = custom
    return options


def reserve_stage_nodes(bundles: list[dict], timeout_s: float = STAGE_GROUP_TIMEOUT_S):
    """A STRICT_SPREAD placement group of `bundles`, once Ray has placed it: (the group, bundle 0's node id).
    Raises TimeoutError (the group removed) when the cluster has too few nodes for it in time."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    group = placement_group(bundles, strategy="STRICT_SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(f"no {len(bundles)} distinct nodes can hold a stage each ({bundles[0]}) "
                           f"after {timeout_s:.0f} s")
    return group, placement_group_table(group)["bundles_to_node_id"][0]


def release(group) -> None:
    """Remove a worker's placement group (its stage actors go with it)."""
    from ray.util.placement_group import remove_placement_group
    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - already gone with the cluster
        pass
