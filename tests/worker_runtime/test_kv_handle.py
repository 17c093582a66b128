"""worker_runtime/kv_handle.py: a KV handle is checked field by field before it reaches the engine thread."""
import pytest

from common.protocol import worker_pb2
from engine.sampling_params import InvalidParameter
from worker_runtime.kv_handle import MAX_BLOCK_ID, MAX_HOST_CHARS, KVSource, peer_to_proto

PEER = {"backend": "tcp", "modes": ["shm", "tcp"], "host": "10.0.0.2", "port": 7001, "instance_id": "abc",
        "protocol_version": 3, "compat_hash": "9f", "tls": True}


def handle(peer=None, **fields) -> worker_pb2.KVHandle:
    base = {"peer": peer_to_proto(PEER) if peer is None else peer, "transfer_id": "t-1", "block_ids": [4, 9, 2],
            "capability": "c"}
    return worker_pb2.KVHandle(**(base | fields))


def test_a_good_handle_is_parsed_back_to_the_senders_peer_info():
    source = KVSource.from_handle(handle(), first_token_id=17)
    assert (source.peer_info, source.transfer_id, source.block_ids, source.first_token_id, source.capability) == (
        PEER, "t-1", [4, 9, 2], 17, "c")
    with_ipc = KVSource.from_handle(handle(peer_to_proto(PEER | {"ipc_host": "node-1"})), 0)
    assert with_ipc.peer_info == PEER | {"ipc_host": "node-1"}


def test_a_backend_alone_names_the_data_path():
    info = KVSource.from_handle(handle(worker_pb2.KVPeer(host="h", port=1, backend="tcp")), 0).peer_info
    assert info["modes"] is None and info["backend"] == "tcp"  # the receiver falls back to the backend


def peer(**changes) -> worker_pb2.KVPeer:
    return peer_to_proto(PEER | changes)


@pytest.mark.parametrize(("kv", "field_name"), [
    (worker_pb2.KVHandle(transfer_id="t", block_ids=[1]), "kv.peer"),
    (handle(peer(host="")), "kv.peer.host"),
    (handle(peer(host="h" * (MAX_HOST_CHARS + 1))), "kv.peer.host"),
    (handle(peer(port=0)), "kv.peer.port"),
    (handle(peer(port=70000)), "kv.peer.port"),
    (handle(peer(modes=[], backend="")), "kv.peer.modes"),
    (handle(peer(modes=["x" * 33])), "kv.peer.modes"),
    (handle(peer(modes=["tcp"] * 9)), "kv.peer.modes"),
    (handle(peer(instance_id="i" * 257)), "kv.peer.instance_id"),
    (handle(peer(compat_hash="h" * 257)), "kv.peer.compat_hash"),
    (handle(transfer_id=""), "kv.transfer_id"),
    (handle(transfer_id="x" * 257), "kv.transfer_id"),
    (handle(block_ids=[]), "kv.block_ids"),
    (handle(block_ids=[1, 1]), "kv.block_ids"),
    (handle(block_ids=[MAX_BLOCK_ID + 1]), "kv.block_ids"),
    (handle(capability="c" * 257), "kv.capability"),
])
def test_each_bad_field_is_refused_by_name(kv, field_name):
    with pytest.raises(InvalidParameter) as caught:
        KVSource.from_handle(kv, 0)
    assert caught.value.field == field_name
