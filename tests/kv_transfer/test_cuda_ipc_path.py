"""The same-host CUDA IPC data mode, on any machine.

- The block-copy kernel the receiver runs over the mapped pool: under Triton's
  interpreter on CPU (compiled on a GPU host), bit-exact against numpy on
  random non-contiguous block sets, for every row width it picks.
- Mode choice: a receiver only asks a sender for ``cuda_ipc`` when both are on
  one host (boot, pid and IPC namespaces) and it could copy on a GPU.
- Fallback: when the sender's pool cannot be mapped, the link falls back to the
  next path for good and the transfer still completes bit-exact (here forced by
  a sender offering IPC on host memory, which no CUDA driver can map).

The pulls themselves between two processes on one GPU are in test_cuda_transfer.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="the triton wheel is part of the test install")

from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender  # noqa: E402
from kv_transfer.block_copy import as_block_rows, copy_blocks  # noqa: E402
from kv_transfer.cuda_ipc import host_identity  # noqa: E402
from kv_transfer.ipc_path import IpcSendPath  # noqa: E402

from .helpers import assert_no_leak  # noqa: E402
from .peers import SMOLLM2, make_pool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block_nbytes,row_dtype", [(4096, torch.int64), (36, torch.int32), (18, torch.int16),
                                                    (9, torch.uint8)])
def test_copy_kernel_moves_exactly_the_listed_blocks(block_nbytes, row_dtype):
    gen = torch.Generator().manual_seed(block_nbytes)
    src_flat = torch.randint(0, 256, (64 * block_nbytes,), dtype=torch.uint8, generator=gen).to(DEVICE)
    dst_flat = torch.randint(0, 256, (48 * block_nbytes,), dtype=torch.uint8, generator=gen).to(DEVICE)
    src, dst = as_block_rows(src_flat, block_nbytes), as_block_rows(dst_flat, block_nbytes)
    assert src.dtype == row_dtype and dst.shape[0] == 48
    rng = np.random.default_rng(block_nbytes)
    src_ids = rng.choice(64, 20, replace=False)
    dst_ids = rng.choice(48, 20, replace=False)
    expected = dst_flat.cpu().numpy().reshape(48, block_nbytes).copy()
    expected[dst_ids] = src_flat.cpu().numpy().reshape(64, block_nbytes)[src_ids]
    ids = torch.tensor(np.stack([src_ids, dst_ids]), dtype=torch.int32, device=DEVICE)
    copy_blocks(dst, src, ids[1], ids[0])
    np.testing.assert_array_equal(dst_flat.cpu().numpy().reshape(48, block_nbytes), expected)


def test_copy_kernel_checks_shapes():
    a = torch.zeros(4, 8, dtype=torch.int64)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="block rows differ"):
        copy_blocks(a, torch.zeros(4, 4, dtype=torch.int64), ids, ids)
    with pytest.raises(ValueError, match="destination ids"):
        copy_blocks(a, a.clone(), ids[:1], ids)


def test_host_identity_names_boot_and_namespaces():
    ident = host_identity().split(":")
    assert len(ident) == 3 and ident[0] and all(part.isdigit() for part in ident[1:])
    assert host_identity() == ":".join(ident)


LAYOUT = KVLayout(dtype="float32", **SMOLLM2)


class _FakePuller:
    """Stands in for a GPU copier so a CPU receiver considers CUDA IPC."""


def test_mode_asks_for_ipc_only_on_the_same_host(thread_guard):
    pool = make_pool(LAYOUT, 4, 1)
    with make_receiver(pool, LAYOUT, KVTransferConfig(backend="tcp")) as recv:
        info = {"host": "127.0.0.1", "port": 1, "instance_id": "x", "modes": ["cuda_ipc", "tcp"]}
        same_host = {**info, "ipc_host": host_identity()}
        assert recv.choose_path(same_host).name == "tcp"  # host pool: no GPU copier
        ipc = recv.path_named("cuda_ipc")
        ipc.puller = _FakePuller()
        assert recv.choose_path(same_host) is ipc
        assert recv.choose_path({**info, "ipc_host": "other-boot:1:2"}).name == "tcp"
        assert recv.choose_path(info).name == "tcp"
        assert recv.fall_back(same_host, ipc).name == "tcp"  # failed with instance "x": not asked again
        assert recv.choose_path(same_host).name == "tcp"
        assert recv.choose_path({**same_host, "instance_id": "y"}) is ipc  # a new sender instance: tried again


def test_unmappable_pool_falls_back_and_stays_exact(monkeypatch, thread_guard):
    """A sender offers CUDA IPC for a pool the receiver cannot map: the link drops to tcp
    for that sender instance, this and later transfers complete, nothing leaks."""
    fake = {"ipc_handle": "00" * 64, "ipc_offset": 0, "ipc_nbytes": LAYOUT.block_nbytes * 16,
            "ipc_host": host_identity()}
    monkeypatch.setattr(IpcSendPath, "for_region", classmethod(lambda cls, region, config: cls(region, dict(fake))))
    src = make_pool(LAYOUT, 16, 1)
    dst = make_pool(LAYOUT, 16, 2)
    with make_sender(src, LAYOUT, KVTransferConfig(backend="tcp")) as sender, \
            make_receiver(dst, LAYOUT, KVTransferConfig(backend="tcp")) as recv:
        recv.path_named("cuda_ipc").puller = _FakePuller()
        info = sender.peer_info()
        assert info["modes"][0] == "cuda_ipc" and info["ipc_host"] == host_identity()
        for tid, remote, local in [("a", [9, 2, 14], [0, 5, 3]), ("b", [1, 0], [15, 8])]:
            st = sender.expect(tid, remote, 10)
            t = recv.read(info, tid, remote, local, timeout_s=10, capability=st.capability)
            assert t.wait(10) == TransferState.DONE, t.error
            assert st.wait(10) == TransferState.DONE
            np.testing.assert_array_equal(dst[local], src[remote])
        assert recv.choose_path(info).name == "tcp"  # for good, with this sender instance
        assert recv.stats()["cuda_ipc_pulls"] == 0
        assert_no_leak(recv.stats())
        assert_no_leak(sender.stats())
    assert_no_leak(recv.stats(), closed=True)
