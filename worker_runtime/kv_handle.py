"""A prefill worker's KV handle as the decode side receives it: parsed and checked before the engine thread.

The handle (`worker_pb2.KVHandle`) is caller input on the decode worker (a router relays it), so each
field is checked here and a bad one is refused as `InvalidParameter` naming it (INVALID_ARGUMENT):
  peer            the prefill worker's KV sender (`KVPeer`, typed: `KVSender.peer_info()` field by field):
                  host, port in [1, 65535], instance id, the data paths (`modes`, or its `backend`),
                  every string bounded
  transfer_id     1 to MAX_TRANSFER_ID_CHARS characters
  block_ids       non-empty, distinct, each in [0, MAX_BLOCK_ID]
  capability      at most MAX_TRANSFER_ID_CHARS characters (the sender's per-transfer secret)
Whether the handle was signed by a router of the cluster is checked before this
(`common.cluster_auth.handles.verify`); for a request's `prefix_kv` (a peer's lease on the prompt's
leading blocks), `prefix_source` checks both.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.cluster_auth import handles
from common.protocol import worker_pb2
from engine.sampling_params import InvalidParameter
from kv_transfer.layer_split import MAX_STAGES, check_stages

MAX_HOST_CHARS = 255
MAX_NAME_CHARS = 32
MAX_MODES = 8
MAX_TRANSFER_ID_CHARS = 256
MAX_BLOCK_ID = 2**31 - 1


@dataclass
class KVSource:
    """Where a prompt's KV waits (from the prefill worker's KV handle)."""

    peer_info: dict
    transfer_id: str
    block_ids: list[int]
    first_token_id: int | None
    """The prefill worker's first token (None: a prefix pulled by another prefill worker)."""
    capability: str = ""
    """The prefill worker's secret for this transfer (its sender refuses reads without it)."""

    @classmethod
    def from_handle(cls, handle, first_token_id: int | None = None, field: str = "kv") -> KVSource:
        """Parse a KVHandle (the message field `field`); raises InvalidParameter naming the field (the handle
        is caller input)."""
        _need(len(handle.capability) <= MAX_TRANSFER_ID_CHARS, f"{field}.capability", "too long")
        _need(handle.HasField("peer"), f"{field}.peer", "missing")
        return cls(parse_peer(handle.peer, field), check_transfer_id(handle.transfer_id, field),
                   check_block_ids(list(handle.block_ids), field), first_token_id, handle.capability)


def prefix_source(request, prompt: list[int], block_size: int, handle_key: bytes | None) -> KVSource | None:
    """The checked `prefix_kv` of a Prefill or Decode call (None without one): signed by a router for the
    prompt's first `num_tokens` tokens, whole blocks, one block id per block. Raises InvalidParameter."""
    if not request.HasField("prefix_kv"):
        return None
    handle = request.prefix_kv
    if not 0 < handle.num_tokens <= len(prompt) or handle.num_tokens % block_size:
        raise InvalidParameter("prefix_kv.num_tokens", f"must be whole blocks of {block_size} tokens within "
                                                       f"the prompt, got {handle.num_tokens}")
    if len(handle.block_ids) != handle.num_tokens // block_size:
        raise InvalidParameter("prefix_kv.block_ids", "must have one id per block of num_tokens")
    if handle_key is not None and not handles.verify(handle_key, handle, prompt[:handle.num_tokens]):
        raise InvalidParameter("prefix_kv", "the handle is not signed by a router of this cluster for this prompt")
    return KVSource.from_handle(handle, field="prefix_kv")


def peer_to_proto(info: dict) -> worker_pb2.KVPeer:
    """The prefill side: `KVSender.peer_info()` as the handle's typed `peer` (with a layer-split sender's
    stages, kv_transfer/layer_split.py)."""
    stages = [worker_pb2.KVStagePeer(peer=peer_to_proto(s["peer"]), first_layer=s["first_layer"],
                                     num_layers=s["num_layers"]) for s in info.get("stages") or ()]
    return worker_pb2.KVPeer(host=info["host"], port=info["port"], instance_id=str(info.get("instance_id", "")),
                             modes=info.get("modes") or [], backend=info.get("backend", ""),
                             protocol_version=info.get("protocol_version", 0),
                             compat_hash=info.get("compat_hash", ""), tls=bool(info.get("tls")),
                             ipc_host=info.get("ipc_host", ""), stages=stages)


def parse_peer(peer: worker_pb2.KVPeer, field: str = "kv", name: str = "") -> dict:
    """`kv.peer` checked, as the dict kv_transfer's receiver reads (`KVSender.peer_info()`'s keys; ipc_host
    and stages only when set). Anything else is refused here, before it reaches the engine thread."""
    name = name or f"{field}.peer"
    _need(0 < len(peer.host) <= MAX_HOST_CHARS, f"{name}.host", f"must have 1 to {MAX_HOST_CHARS} characters")
    _need(0 < peer.port <= 65535, f"{name}.port", "must be in [1, 65535]")
    _need(len(peer.instance_id) <= MAX_TRANSFER_ID_CHARS, f"{name}.instance_id", "too long")
    _need(len(peer.modes) <= MAX_MODES and all(0 < len(m) <= MAX_NAME_CHARS for m in peer.modes),
          f"{name}.modes", f"at most {MAX_MODES} names of 1 to {MAX_NAME_CHARS} characters")
    _need(bool(peer.modes) or 0 < len(peer.backend) <= MAX_NAME_CHARS, f"{name}.modes",
          "modes or backend must name a data path")
    _need(len(peer.backend) <= MAX_NAME_CHARS, f"{name}.backend", "too long")
    _need(len(peer.compat_hash) <= MAX_TRANSFER_ID_CHARS, f"{name}.compat_hash", "too long")
    _need(len(peer.ipc_host) <= MAX_HOST_CHARS, f"{name}.ipc_host", "too long")
    info = {"backend": peer.backend, "modes": list(peer.modes) or None, "host": peer.host, "port": peer.port,
            "instance_id": peer.instance_id, "protocol_version": peer.protocol_version,
            "compat_hash": peer.compat_hash, "tls": peer.tls}
    if peer.ipc_host:
        info["ipc_host"] = peer.ipc_host
    if peer.stages:
        info["stages"] = _parse_stages(peer, name)
    return info


def _parse_stages(peer: worker_pb2.KVPeer, name: str) -> list[dict]:
    _need(len(peer.stages) <= MAX_STAGES, f"{name}.stages", f"at most {MAX_STAGES}")
    stages = []
    for i, stage in enumerate(peer.stages):
        _need(stage.HasField("peer") and not stage.peer.stages, f"{name}.stages[{i}].peer",
              "must be one stage's sender")
        stages.append({"peer": parse_peer(stage.peer, name=f"{name}.stages[{i}].peer"),
                       "first_layer": stage.first_layer, "num_layers": stage.num_layers})
    try:
        check_stages(stages, sum(s["num_layers"] for s in stages))
    except ValueError as exc:
        raise InvalidParameter(f"{name}.stages", str(exc)) from None
    return stages


def check_transfer_id(transfer_id: str, field: str = "kv") -> str:
    _need(0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS, f"{field}.transfer_id",
          f"must have 1 to {MAX_TRANSFER_ID_CHARS} characters")
    return transfer_id


def check_block_ids(block_ids: list[int], field: str = "kv") -> list[int]:
    name = f"{field}.block_ids"
    _need(bool(block_ids), name, "empty")
    _need(all(0 <= b <= MAX_BLOCK_ID for b in block_ids), name, f"ids must be in [0, {MAX_BLOCK_ID}]")
    _need(len(set(block_ids)) == len(block_ids), name, "ids must be distinct")
    return block_ids


def _need(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(field_name, message)
