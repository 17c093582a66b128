"""The chart's KV cache tiers (prefill/decode.kvOffload): flags, the disk volume, render checks, schema."""
from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest

from tests.helm.chart import (
    KUBE_VERSION,
    assert_schema_refuses,
    by_kind,
    objects,
    pod_specs,
    template,
    values_args,
)
from tests.helm.custom_resources import SCHEMAS

KV_TIERS = ("--set", "prefill.kvOffload.cpuGiB=32", "--set", "prefill.kvOffload.disk.enabled=true",
            "--set", "prefill.kvOffload.disk.sizeGiB=200")


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_kv_tiers_reach_the_pool_asking_for_them_with_the_disk_volume_mounted():
    objs = objects(template(*KV_TIERS))
    pods = {name.rsplit("-", 1)[1]: spec for name, spec in pod_specs(objs) if name.startswith("Deployment/")}
    prefill, decode = pods["prefill"], pods["decode"]
    [container] = prefill["containers"]
    args = container["args"]
    assert flag(args, "--kv-offload-cpu-gib") == "32"
    assert flag(args, "--kv-offload-dir") == "/var/cache/pdserve/kv"
    assert flag(args, "--kv-offload-disk-gib") == "200"
    assert {"name": "kv-offload", "mountPath": "/var/cache/pdserve/kv"} in container["volumeMounts"]
    # an emptyDir by default, with room for the arena's header and block records past its blocks
    assert {"name": "kv-offload", "emptyDir": {"sizeLimit": "201Gi"}} in prefill["volumes"]
    # decode keeps its defaults: no tiers, no volume
    assert not any(a.startswith("--kv-offload") for a in decode["containers"][0]["args"])
    assert "kv-offload" not in [v["name"] for v in decode["volumes"]]
    for obj in by_kind(objs, "Deployment"):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_kv_tiers_on_a_host_path_and_the_host_tier_alone():
    values = {"cpuGiB": 0.5, "disk": {"enabled": True, "sizeGiB": 1.5,
                                      "volume": {"type": "hostPath", "hostPath": "/mnt/nvme/pdserve"}}}
    objs = objects(template("--set-json", f"decode.kvOffload={json.dumps(values)}",
                            "--set", "prefill.kvOffload.cpuGiB=8"))
    pods = {name.rsplit("-", 1)[1]: spec for name, spec in pod_specs(objs) if name.startswith("Deployment/")}
    decode_args = pods["decode"]["containers"][0]["args"]
    assert (flag(decode_args, "--kv-offload-cpu-gib"), flag(decode_args, "--kv-offload-disk-gib")) == ("0.5", "1.5")
    assert {"name": "kv-offload", "hostPath": {"path": "/mnt/nvme/pdserve", "type": "Directory"}} in \
        pods["decode"]["volumes"]
    prefill_args = pods["prefill"]["containers"][0]["args"]
    assert flag(prefill_args, "--kv-offload-cpu-gib") == "8"
    assert "--kv-offload-dir" not in prefill_args and "--kv-offload-disk-gib" not in prefill_args
    assert "kv-offload" not in [v["name"] for v in pods["prefill"]["volumes"]]


def test_kv_tiers_in_raycluster_mode_go_on_serve_and_the_worker_groups():
    both = [*KV_TIERS, *(a.replace("prefill.", "decode.") for a in KV_TIERS)]
    objs = objects(template(*values_args("raycluster"), *both))
    [ray] = by_kind(objs, "RayCluster")
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--kv-offload-cpu-gib 32 --kv-offload-dir /var/cache/pdserve/kv --kv-offload-disk-gib 200" in head
    for group in ray["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        assert {"name": "kv-offload", "mountPath": "/var/cache/pdserve/kv"} in spec["containers"][0]["volumeMounts"]
        assert {"name": "kv-offload", "emptyDir": {"sizeLimit": "201Gi"}} in spec["volumes"]
    jsonschema.validate(ray, SCHEMAS[("ray.io/v1", "RayCluster")])
    with pytest.raises(ValueError, match="prefill.kvOffload and decode.kvOffload must ask for the same tiers"):
        template(*values_args("raycluster"), *KV_TIERS)


KV_TIER_ERRORS = [
    (("--set", "prefill.kvOffload.disk.enabled=true", "--set", "prefill.kvOffload.disk.sizeGiB=10"),
     "prefill.kvOffload.disk.enabled needs prefill.kvOffload.cpuGiB > 0"),
    (("--set", "decode.kvOffload.cpuGiB=4", "--set", "decode.kvOffload.disk.enabled=true"),
     "decode.kvOffload.disk.enabled needs decode.kvOffload.disk.sizeGiB > 0"),
    ((*KV_TIERS, "--set", "prefill.kvOffload.disk.volume.type=hostPath"),
     "prefill.kvOffload.disk.volume.type=hostPath needs prefill.kvOffload.disk.volume.hostPath"),
    (("--set", "prefill.kvOffload.cpuGiB=64"),
     "prefill.kvOffload.cpuGiB=64 lives in the container's memory: prefill.resources.limits.memory (64Gi) must be "
     "larger"),
]


@pytest.mark.parametrize("settings,message", KV_TIER_ERRORS, ids=["disk-without-cpu", "disk-without-size",
                                                                   "hostPath-without-path", "cpu-over-memory"])
def test_kv_tier_render_fails_with_a_clear_message(settings, message):
    with pytest.raises(ValueError) as refused:
        template(*settings)
    assert message in str(refused.value)


def test_schema_refuses_bad_kv_tier_values():
    assert_schema_refuses("prefill.kvOffload.cpuGiB=-1", "at '/prefill/kvOffload/cpuGiB'")
    assert_schema_refuses("decode.kvOffload.disk.volume.type=nfs", "at '/decode/kvOffload/disk/volume/type'")
    assert_schema_refuses("prefill.kvOffload.disk.volume.hostPath=relative/dir",
                          "at '/prefill/kvOffload/disk/volume/hostPath'")
    assert_schema_refuses("prefill.kvOffload.disks.enabled=true", "additional properties 'disks' not allowed")
