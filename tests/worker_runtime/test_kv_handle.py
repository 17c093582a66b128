"""worker_runtime/kv_handle.py: a KV handle is checked field by field before it reaches the engine thread."""
import json

import pytest

from common.protocol import worker_pb2
from engine.sampling_params import InvalidParameter
from worker_runtime.kv_handle import MAX_BLOCK_ID, MAX_PEER_INFO_CHARS, KVSource

PEER = {"host": "10.0.0.2", "port": 7001, "instance_id": "abc", "modes": ["tcp"]}


def handle(**fields) -> worker_pb2.KVHandle:
    base = {"peer_info_json": json.dumps(PEER), "transfer_id": "t-1", "block_ids": [4, 9, 2], "capability": "c"}
    return worker_pb2.KVHandle(**(base | fields))


def test_a_good_handle_is_parsed():
    source = KVSource.from_handle(handle(), first_token_id=17)
    assert (source.peer_info, source.transfer_id, source.block_ids, source.first_token_id, source.capability) == (
        PEER, "t-1", [4, 9, 2], 17, "c")


def test_the_older_single_backend_form_is_accepted():
    info = {"host": "h", "port": 1, "backend": "tcp"}
    assert KVSource.from_handle(handle(peer_info_json=json.dumps(info)), 0).peer_info == info


@pytest.mark.parametrize(("fields", "field_name"), [
    ({"peer_info_json": "{"}, "kv.peer_info_json"),
    ({"peer_info_json": "[1]"}, "kv.peer_info_json"),
    ({"peer_info_json": json.dumps(PEER) + " " * MAX_PEER_INFO_CHARS}, "kv.peer_info_json"),
    ({"peer_info_json": json.dumps(PEER | {"host": ""})}, "kv.peer_info_json.host"),
    ({"peer_info_json": json.dumps(PEER | {"port": 70000})}, "kv.peer_info_json.port"),
    ({"peer_info_json": json.dumps(PEER | {"port": True})}, "kv.peer_info_json.port"),
    ({"peer_info_json": json.dumps(PEER | {"modes": []})}, "kv.peer_info_json.modes"),
    ({"peer_info_json": json.dumps({"host": "h", "port": 1})}, "kv.peer_info_json.backend"),
    ({"transfer_id": ""}, "kv.transfer_id"),
    ({"transfer_id": "x" * 257}, "kv.transfer_id"),
    ({"block_ids": []}, "kv.block_ids"),
    ({"block_ids": [1, 1]}, "kv.block_ids"),
    ({"block_ids": [MAX_BLOCK_ID + 1]}, "kv.block_ids"),
    ({"capability": "c" * 257}, "kv.capability"),
])
def test_each_bad_field_is_refused_by_name(fields, field_name):
    with pytest.raises(InvalidParameter) as caught:
        KVSource.from_handle(handle(**fields), 0)
    assert caught.value.field == field_name
