"""Pipeline stages on other nodes: the KV each one serves itself, and the first stage's link to it.

A stage on another node (engine/parallel/ray_stages.py starts it) has no memory the worker process can map,
so it serves the KV of its layers from a kv_transfer sender of its own, on its node: each layer range crosses
its own link (kv_transfer/layer_split.py). The first stage drives those senders over the stage's control
connection, the one that carries its steps, so a lease always follows the steps that wrote its blocks:

  first stage -> stage   ("open_sender", kv_config, layout)    open the sender (the worker's layout, this
                                                               stage's layer range)
                         ("expect", transfer_id, block_ids, timeout_s, capability)   lease blocks
                         ("release", transfer_id, reason)       end a lease early
  stage -> first stage   ("sender", peer_info) | ("sender_error", text)
                         ("lease", transfer_id, state, error, bytes_moved)   a lease ended
                         ("error", traceback)                   the stage failed

`StageKVServer` is the stage's half (run by `ranks.run_rank`), `RemoteStage` the first stage's (a
`kv_transfer.layer_split.StageSender`; its reader thread owns the connection's incoming side once the stage
is ready). A stage that goes away fails every lease it held, so no piece of a transfer waits forever.
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

from kv_transfer import KVTransferConfig, TransferState, make_sender
from kv_transfer.layout import KVLayout

logger = logging.getLogger(__name__)
OPEN_TIMEOUT_S = 60.0
REPORT_GRACE_S = 10.0
"""How long past its deadline a lease may go unreported before the first stage counts it failed."""


class StageKVServer:
    """A remote stage's KV sender (opened on the first stage's request) and its leases."""

    def __init__(self, kv_cache: Any, host: str, send) -> None:
        self.kv_cache = kv_cache
        self.host = host
        """This stage's node address (as Ray knows it): where its sender listens and what peers dial."""
        self._send = send
        self.sender = None
        self._leases: dict[str, Any] = {}

    def handle(self, kind: str, args: tuple) -> bool:
        """Serve one control message; False when it is not a KV one."""
        if kind == "open_sender":
            self._open(*args)
        elif kind == "expect":
            self._expect(*args)
        elif kind == "release":
            transfer_id, reason = args
            lease = self._leases.get(transfer_id)
            if lease is not None:
                lease.request_stop(reason, interrupt=True)
        else:
            return False
        return True

    def _open(self, kv_config: KVTransferConfig, layout: KVLayout) -> None:
        try:
            config = dataclasses.replace(kv_config, host=self.host, port=0, advertise_host=self.host)
            self.sender = make_sender(self.kv_cache, layout, config)
            self._send(("sender", self.sender.peer_info()))
        except Exception as exc:  # noqa: BLE001 - reported to the first stage, which fails the worker's start
            self._send(("sender_error", f"{type(exc).__name__}: {exc}"))

    def _expect(self, transfer_id: str, block_ids: list[int], timeout_s: float, capability: str) -> None:
        try:
            lease = self.sender.expect(transfer_id, block_ids, max(0.01, timeout_s), capability)
        except Exception as exc:  # noqa: BLE001 - that lease fails, the stage goes on
            self._send(("lease", transfer_id, int(TransferState.FAILED), f"{type(exc).__name__}: {exc}", 0))
            return
        self._leases[transfer_id] = lease
        lease.add_finish_hook(self._finished)

    def _finished(self, lease) -> None:
        """A finish hook: runs as the lease turns terminal (before `state` says so; a failure has its reason)."""
        self._leases.pop(lease.transfer_id, None)
        state = TransferState.DONE if lease.error is None else TransferState.FAILED
        self._send(("lease", lease.transfer_id, int(state), lease.error, lease.bytes_moved))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class RemoteLease:
    """The first stage's view of one stage's lease (a piece of a kv_transfer StagedTransfer)."""

    def __init__(self, stage: RemoteStage, transfer_id: str, block_ids: Sequence[int], timeout_s: float,
                 capability: str) -> None:
        self.stage = stage
        self.transfer_id = transfer_id
        self.block_ids = tuple(block_ids)
        self.capability = capability
        self.created = time.monotonic()
        self.deadline = self.created + timeout_s
        self.state = TransferState.WAITING
        self.error: str | None = None
        self.bytes_moved = 0
        self.finished_at: float | None = None
        self._stop_sent = False
        self._done = threading.Event()

    @property
    def elapsed_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.created

    def finish(self, state: TransferState, error: str | None, bytes_moved: int = 0) -> None:
        if self.state.is_terminal:
            return
        self.error, self.bytes_moved, self.finished_at = error, bytes_moved, time.monotonic()
        self.state = state
        self._done.set()

    def poll(self) -> TransferState:
        if not self.state.is_terminal and time.monotonic() > self.deadline + REPORT_GRACE_S:
            self.finish(TransferState.FAILED, f"stage {self.stage.stage} did not report its lease")
        return self.state

    def request_stop(self, reason: str, interrupt: bool = False) -> None:
        if not self.state.is_terminal and not self._stop_sent:
            self._stop_sent = True
            self.stage.release(self.transfer_id, reason)

    def abort(self, reason: str = "aborted by caller") -> TransferState:
        self.request_stop(reason)
        self._done.wait(max(0.0, min(5.0, self.deadline + REPORT_GRACE_S - time.monotonic())))
        return self.poll()

    def wait(self, timeout: float | None = None) -> TransferState:
        self._done.wait(timeout)
        return self.poll()


class RemoteStage:
    """The first stage's link to pipeline stage `stage` on another node: its sender's address and its leases."""

    def __init__(self, stage: int, first_layer: int, num_layers: int, conn, send) -> None:
        self.stage = stage
        self.first_layer = first_layer
        self.num_layers = num_layers
        self._conn = conn
        self._send = send
        """The executor's send to this stage's first rank (one lock with the steps)."""
        self._leases: dict[str, RemoteLease] = {}
        self._lock = threading.Lock()
        self._sender_info: dict | None = None
        self._sender_error: str | None = None
        self._opened = threading.Event()
        self.error: str | None = None
        """Why the stage is gone (its traceback, or the connection closing); None while it runs."""
        self.bytes_moved = 0
        """Bytes the stage's sender served for the leases that ended (as it reports them)."""
        self._reader = threading.Thread(target=self._read, name=f"pdserve-stage{stage}-reader", daemon=True)
        self._reader.start()

    def peer_info(self) -> dict:
        if self._sender_info is None:
            raise RuntimeError(f"stage {self.stage} has no KV sender open")
        return self._sender_info

    def open_sender(self, kv_config: KVTransferConfig, layout: KVLayout) -> None:
        """Open the stage's sender for the worker's `layout` (this stage's layers of it); blocks until it is."""
        stage_layout = dataclasses.replace(layout, num_layers=self.num_layers, first_layer=self.first_layer)
        self._send(("open_sender", kv_config, stage_layout))
        if not self._opened.wait(OPEN_TIMEOUT_S) or self._sender_error or self.error:
            raise RuntimeError(f"stage {self.stage} could not open its KV sender: "
                               f"{self._sender_error or self.error or 'no answer'}")

    def expect(self, transfer_id: str, block_ids: Sequence[int], timeout_s: float, capability: str) -> RemoteLease:
        lease = RemoteLease(self, transfer_id, block_ids, timeout_s, capability)
        with self._lock:
            if self.error is not None:
                raise RuntimeError(f"stage {self.stage} is gone: {self.error}")
            self._leases[transfer_id] = lease
        self._send(("expect", transfer_id, list(block_ids), timeout_s, capability))
        return lease

    def release(self, transfer_id: str, reason: str) -> None:
        try:
            self._send(("release", transfer_id, reason))
        except RuntimeError:
            pass  # the stage is gone: the reader fails its leases

    def _read(self) -> None:
        try:
            while True:
                kind, *args = pickle.loads(self._conn.recv_bytes())
                if kind == "lease":
                    transfer_id, state, error, nbytes = args
                    with self._lock:
                        lease = self._leases.pop(transfer_id, None)
                    self.bytes_moved += nbytes
                    if lease is not None:
                        lease.finish(TransferState(state), error, nbytes)
                elif kind == "sender":
                    self._sender_info = args[0]
                    self._opened.set()
                elif kind == "sender_error":
                    self._sender_error = args[0]
                    self._opened.set()
                elif kind == "error":
                    self.error = args[0]
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            self.error = self.error or f"its control connection closed ({type(exc).__name__})"
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            lease.finish(TransferState.FAILED, f"stage {self.stage} is gone: {self.error}")
        self._opened.set()
