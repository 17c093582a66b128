"""The flags of the commands that run the engine, a worker, the router or the whole cluster, made from their
config dataclasses (common/config_flags.py), and the configs built from the parsed flags.

One name per concept across commands; the spellings a command took before (`OLD_NAMES`, the README's table)
are still accepted there, hidden from --help, for one release.
"""
from __future__ import annotations

import argparse

from common.config_flags import ConfigFlags
from engine.config import EngineConfig
from pdserve.cluster_config import ClusterConfig
from router.config import RouterConfig
from worker_runtime.config import WorkerConfig

SECTIONS = ("cluster (Ray)", "engine", "KV cache", "KV cache tiers", "speculative decoding", "worker", "KV transfer",
            "router", "routing", "OpenAI HTTP front", "registry (Redis)", "security", "planner")
"""--help sections, in this order; a flag several configs share is listed in the first of theirs."""

OLD_NAMES: dict[str, dict[str, str]] = {
    "prefill-worker, decode-worker": {f"--tls-{part}": f"--internal-tls-{part}" for part in ("cert", "key", "ca")},
    "router": {**{f"--worker-tls-{part}": f"--internal-tls-{part}" for part in ("cert", "key", "ca", "server-name")},
               "--api-key-file": "--api-keys-file"},
    "serve": {"--api-key-file": "--api-keys-file"},
}
"""{commands: {old flag: new flag}}."""


def _aliases(commands: str) -> dict[str, list[str]]:
    aliases: dict[str, list[str]] = {}
    for old, new in OLD_NAMES[commands].items():
        aliases.setdefault(new, []).append(old)
    return aliases


ENGINE_FLAGS = ConfigFlags(EngineConfig, "engine", sections=SECTIONS)
WORKER_FLAGS = ConfigFlags(WorkerConfig, "worker", exclude=("tls.server_name",),
                           aliases=_aliases("prefill-worker, decode-worker"), sections=SECTIONS)
ROUTER_FLAGS = ConfigFlags(RouterConfig, "router", aliases=_aliases("router"), sections=SECTIONS)
SERVE_FLAGS = ConfigFlags(
    ClusterConfig, "cluster (Ray)", aliases=_aliases("serve"), sections=SECTIONS,
    exclude=("router.prefill_workers", "router.decode_workers",  # Ray places the workers; serve knows them
             "worker.host", "worker.port", "worker.advertise_host", "worker.auth_names", "worker.metrics_port",
             "worker.kv_transfer.advertise_host", "worker.tls.server_name", "worker.kv_tls"))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return ENGINE_FLAGS.build(args)


def worker_config_from_args(args: argparse.Namespace, role: str) -> WorkerConfig:
    """A standalone worker's config: the KV transfer listener binds to --host unless --kv-transfer-host."""
    return WORKER_FLAGS.build(args, {"role": role, "kv_transfer.host": args.kv_transfer_host or args.host})


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    return ROUTER_FLAGS.build(args)


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """`serve`'s config: the worker template (role and ports are set per worker) binds to loopback."""
    return SERVE_FLAGS.build(args, {"log_level": args.log_level.upper(), "worker.role": "decode",
                                    "worker.kv_transfer.host": args.kv_transfer_host or WorkerConfig.host})
