"""The chart's RayCluster runs a Ray with token authentication, turned on, and its dashboard on the
head pod's loopback: what `pdserve serve --ray-address auto` on the head needs to start at all."""
from __future__ import annotations

import re

import pytest

from tests.helm.chart import assert_schema_refuses, by_kind, objects, template, values_args


def ray_version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def test_raycluster_runs_ray_with_token_auth():
    [ray] = by_kind(objects(template(*values_args("raycluster"))), "RayCluster")
    assert ray_version(ray["spec"]["rayVersion"]) >= (2, 52)  # token authentication exists from Ray 2.52
    assert ray["spec"]["authOptions"] == {"mode": "token"}  # KubeRay sets RAY_AUTH_MODE/RAY_AUTH_TOKEN
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"


@pytest.mark.parametrize("version", ["2.50.0", "2.40.1", "1.13.0"])
def test_schema_refuses_a_ray_without_token_auth(version):
    assert_schema_refuses(f"ray.rayVersion={version}", "at '/ray/rayVersion'")


@pytest.mark.parametrize("version", ["2.52.0", "2.60.0", "2.100.1", "3.0.0"])
def test_schema_takes_a_ray_with_token_auth(version):
    [ray] = by_kind(objects(template(*values_args("raycluster"), "--set", f"ray.rayVersion={version}")), "RayCluster")
    assert ray["spec"]["rayVersion"] == version
