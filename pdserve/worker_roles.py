"""The worker roles a command can start: the roof composes a role (prefill_worker/, decode_worker/) with the
shared worker runtime (worker_runtime/), which never imports them."""
from __future__ import annotations

from worker_runtime.config import WorkerConfig
from worker_runtime.role import WorkerRole


def role_for(config: WorkerConfig) -> WorkerRole:
    """The role `config.role` names."""
    if config.role == "prefill":
        from prefill_worker.role import PrefillRole
        return PrefillRole()
    if config.role == "decode":
        from decode_worker.role import DecodeRole
        return DecodeRole()
    raise ValueError(f"unknown worker role {config.role!r} (prefill or decode)")


def worker_server(config: WorkerConfig):
    """A WorkerServer (worker_runtime/server.py) serving the role of `config`."""
    from worker_runtime.server import WorkerServer
    return WorkerServer(config, role_for(config))


def run_worker(config: WorkerConfig) -> int:
    """Process entry point of `pdserve prefill-worker` / `decode-worker`: serve until SIGTERM, then drain."""
    from worker_runtime.server import run_worker as run
    return run(config, role_for(config))
