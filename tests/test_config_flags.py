"""Flags made from the config dataclasses (common/config_flags.py, pdserve/command_flags.py): every flag sets its
field, the defaults are the configs' own, old spellings still land on the new flag, serve's --help is grouped."""
from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from common.config_flags import ConfigFlags
from engine.config import EngineConfig
from pdserve.cli import build_parser
from pdserve.cluster_config import ClusterConfig
from pdserve.command_flags import (
    ENGINE_FLAGS,
    OLD_NAMES,
    ROUTER_FLAGS,
    SECTIONS,
    SERVE_FLAGS,
    WORKER_FLAGS,
    cluster_config_from_args,
    router_config_from_args,
    worker_config_from_args,
)
from planner.cli import PLANNER_FLAGS
from planner.config import PlannerConfig
from router.config import RouterConfig
from worker_runtime.config import WorkerConfig

COMMANDS = {"generate": ENGINE_FLAGS, "prefill-worker": WORKER_FLAGS, "router": ROUTER_FLAGS, "serve": SERVE_FLAGS,
            "planner": PLANNER_FLAGS}
REQUIRED = {"generate": ["--offline", "--input", "in", "--output", "out"], "planner": ["--router-metrics", "http://r"]}
CUSTOM = {"--kv-tier-weights": ("cpu=0.6", {"cpu": 0.6}), "--prefill-workers": ("a:1, b:2", ["a:1", "b:2"]),
          "--decode-workers": ("c:3", ["c:3"]), "--pp-layer-partition": ("10, 20", (10, 20))}
"""Sample text and the value it parses into, for each flag with its own `type`."""


def parse(command: str, *argv: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *REQUIRED.get(command, []), *argv])


def defaults_by_path(cls: type, prefix: str = "") -> dict:
    """{field path: default} of every field with a default, nested configs' fields included."""
    found = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if dataclasses.is_dataclass(default):
            found.update(defaults_by_path(type(default), prefix + f.name + "."))
        else:
            found[prefix + f.name] = default
    return found


ROOT_DEFAULTS = {"generate": defaults_by_path(EngineConfig), "prefill-worker": defaults_by_path(WorkerConfig),
                 "router": defaults_by_path(RouterConfig), "planner": defaults_by_path(PlannerConfig),
                 "serve": {**{f"router.{k}": v for k, v in defaults_by_path(RouterConfig).items()},
                           **{f"worker.{k}": v for k, v in defaults_by_path(WorkerConfig).items()},
                           **{f"planner.{k}": v for k, v in defaults_by_path(PlannerConfig).items()},
                           **{k: v for k, v in defaults_by_path(ClusterConfig).items()
                              if k not in ("router", "worker", "planner")}, "planner": None}}


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flag_given_means_the_configs_defaults(command):
    values = COMMANDS[command].values(parse(command))
    for flag in COMMANDS[command].flags:
        want = flag.meta.get("flag_default", ROOT_DEFAULTS[command][flag.path])
        if flag.meta.get("unit") == "ms" and "flag_default" not in flag.meta:
            assert values[flag.path] == pytest.approx(want), flag.name
        else:
            assert values[flag.path] == want, flag.name


def test_the_configs_built_from_no_flags_are_the_default_configs():
    assert ENGINE_FLAGS.build(parse("generate")) == EngineConfig()
    assert worker_config_from_args(parse("decode-worker"), "decode") == WorkerConfig("decode")
    assert router_config_from_args(parse("router")) == RouterConfig(port=50051)  # the only flag_default
    assert PLANNER_FLAGS.build(parse("planner")) == PlannerConfig()
    assert cluster_config_from_args(parse("serve")) == ClusterConfig(RouterConfig(port=50051), WorkerConfig("decode"))


def sample(flag) -> tuple[list[str], object]:
    """Argv setting `flag` to something other than its default, and the field value that must come of it."""
    if flag.builds_config:
        return [flag.name], True
    if flag.kind is bool:
        return [flag.name], not flag.default
    if flag.meta.get("append"):
        return [flag.name, "x", flag.name, "y"], ("x", "y")
    if "type" in flag.meta:
        text, value = CUSTOM[flag.name]
        return [flag.name, text], value
    if "choices" in flag.meta:
        choice = next(c for c in flag.meta["choices"] if c != flag.flag_default)
        return [flag.name, choice], choice
    if flag.meta.get("unit") == "GiB":
        return [flag.name, "1.5"], 3 << 29
    if flag.meta.get("unit") == "ms":
        return [flag.name, "250"], 0.25
    text = {int: "7", float: "0.5", str: "some-text"}[flag.kind]
    return [flag.name, text], flag.kind(text)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_sets_its_field(command):
    flags = COMMANDS[command]
    assert flags.flags
    for flag in flags.flags:
        argv, want = sample(flag)
        assert flags.values(parse(command, *argv))[flag.path] == want, flag.name


def test_a_flag_several_configs_share_sets_them_all():
    values = SERVE_FLAGS.values(parse("serve", "--lease-s", "40", "--internal-tls-ca", "ca.pem", "--model", "m"))
    assert values["router.lease_s"] == values["worker.lease_s"] == 40.0
    assert values["router.worker_tls.ca_file"] == values["worker.tls.ca_file"] == "ca.pem"
    assert values["router.model"] == values["worker.engine.model"] == "m"


@pytest.mark.parametrize("commands", OLD_NAMES)
def test_old_spellings_land_on_the_new_flag_and_are_hidden(commands):
    for command in commands.split(", "):
        help_text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        for old, new in OLD_NAMES[commands].items():
            assert vars(parse(command, old, "/some/file")) == vars(parse(command, new, "/some/file")), old
            assert re.search(rf"{old}\b(?!-)", help_text) is None and new in help_text


def test_the_readme_lists_every_old_spelling():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for commands, names in OLD_NAMES.items():
        for old, new in names.items():
            assert f"| `{old}` | `{new}` | {commands} |" in readme, old


def test_serve_help_is_grouped_by_component_in_order():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == ["options", *SECTIONS]
    engine = text.split("\nengine:\n")[1].split("\n\n")[0]
    assert "--model MODEL" in engine and "--max-model-len" in engine  # shared with the router, listed once
    assert text.count("--model MODEL ") == 1


@dataclasses.dataclass
class _A:
    lease_s: float = dataclasses.field(default=30.0, metadata={"help": "a"})


@dataclasses.dataclass
class _B:
    lease_s: float = dataclasses.field(default=20.0, metadata={"help": "b"})


@dataclasses.dataclass
class _Both:
    a: _A = dataclasses.field(default_factory=_A)
    b: _B = dataclasses.field(default_factory=_B)


@dataclasses.dataclass
class _Typo:
    x: int = dataclasses.field(default=1, metadata={"help": "x", "flags": "--x"})


def test_configs_that_disagree_on_a_shared_flag_or_misspell_metadata_are_refused():
    with pytest.raises(TypeError, match="--lease-s sets a.lease_s and b.lease_s, which disagree"):
        ConfigFlags(_Both, "g")
    with pytest.raises(TypeError, match="unknown flag metadata"):
        ConfigFlags(_Typo, "g")
