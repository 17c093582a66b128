"""Where `pdserve serve` asks Ray to put worker actors."""
from __future__ import annotations

from pdserve.cluster import actor_options


def test_local_cluster_needs_nothing_but_a_cpu():
    assert actor_options("prefill", False, {"CPU": 2.0}) == {"num_cpus": 1, "num_gpus": 0}


def test_roles_follow_the_worker_groups_that_declare_them():
    kuberay = {"CPU": 24.0, "GPU": 6.0, "pdserve_prefill": 2.0, "pdserve_decode": 4.0}
    assert actor_options("prefill", True, kuberay) == {"num_cpus": 1, "num_gpus": 1,
                                                       "resources": {"pdserve_prefill": 1}}
    assert actor_options("decode", True, kuberay)["resources"] == {"pdserve_decode": 1}
