"""kv_tier_weights: defaults, validation, and the --kv-tier-weights flag."""
import argparse
import dataclasses

import pytest

from pdserve.cli import build_parser
from pdserve.command_flags import cluster_config_from_args, router_config_from_args
from router.routing_policy import Candidate, RoutingPolicy, RoutingWeights

tier_weights = next(f for f in dataclasses.fields(RoutingWeights) if f.name == "kv_tier_weights").metadata["type"]


def test_defaults_and_media_left_out_keep_theirs():
    assert RoutingWeights().kv_tier_weights == {"device": 1.0, "cpu": 0.8, "disk": 0.5}
    assert RoutingWeights(kv_tier_weights={"cpu": 0.6}).kv_tier_weights == {"device": 1.0, "cpu": 0.6, "disk": 0.5}
    assert RoutingWeights(kv_tier_weights={"cpu": 0, "disk": 0}).kv_tier_weights["disk"] == 0.0


@pytest.mark.parametrize("weights,message", [
    ({"tape": 0.3}, "unknown medium 'tape'"),
    ({"device": 0.9}, "device must be 1.0"),
    ({"cpu": 1.2}, "cpu must be in [0, device's weight]"),
    ({"disk": -0.1}, "disk must be in [0, cpu's weight]"),
    ({"cpu": 0.4, "disk": 0.6}, "disk must be in [0, cpu's weight]"),
    ({"cpu": float("nan")}, "cpu must be in"),
])
def test_bad_tier_weights_are_refused(weights, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RoutingWeights(kv_tier_weights=weights)


def test_flag_parsing():
    assert tier_weights("cpu=0.8,disk=0.5") == {"cpu": 0.8, "disk": 0.5}
    assert tier_weights(" disk = 0.25 ,") == {"disk": 0.25}
    for bad in ("cpu", "cpu=high", "=0.5", "cpu=0.8;disk=0.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected MEDIUM=WEIGHT"):
            tier_weights(bad)


@pytest.mark.parametrize("command", ["router", "serve"])
def test_flag_reaches_the_routing_weights(command):
    def router_config(*argv):
        args = build_parser().parse_args([command, *argv])
        return cluster_config_from_args(args).router if command == "serve" else router_config_from_args(args)
    config = router_config("--kv-tier-weights", "cpu=0.7,disk=0.2")
    assert config.routing_weights.kv_tier_weights == {"device": 1.0, "cpu": 0.7, "disk": 0.2}
    default = router_config()
    assert default.routing_weights.kv_tier_weights == {"device": 1.0, "cpu": 0.8, "disk": 0.5}


def test_a_lower_tier_hit_costs_between_a_device_hit_and_a_miss():
    policy = RoutingPolicy("prefix")
    device, cpu, miss = (Candidate("a:1", cached_blocks=40), Candidate("b:1", cached_blocks=32, held_blocks=40),
                         Candidate("c:1"))
    costs = [policy.prefill_cost(c, 40) for c in (device, cpu, miss)]
    assert costs[0] < costs[1] < costs[2]
    assert cpu.held == 40 and device.held == 40 and miss.held == 0
