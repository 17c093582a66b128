"""Tier 3: prefix blocks in one memory-mapped arena file on local disk, found again after a restart.

File layout (`kv_blocks.N.bin` under the tier's directory):

    header   4 KiB   magic, then JSON: format version, the engine's layout key, block bytes, slots
    records  slots x (valid, hash, parent hash, xxh64 of the bytes, write sequence, token ids)
    data     slots x block bytes, from the next 4 KiB boundary

A block's record is marked invalid before its bytes are rewritten and valid
(with the new checksum) after, so a crash leaves at worst a block whose
checksum fails: a load verifies the checksum and refuses the block. A file
whose header does not describe this engine's layout (another model, dtype,
block size, tensor-parallel split, ...) is discarded on open, never loaded.
An exclusive lock keeps two workers from sharing one file: a worker takes the
first file no other worker holds, so workers of one node can share a directory
(any file of the same layout holds KV valid for any of them).
"""
from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import struct
from pathlib import Path

import numpy as np
import torch
import xxhash

from engine.block_hash import NO_PARENT
from engine.kv_offload.tier_index import TierIndex

logger = logging.getLogger(__name__)

MAX_FILES = 64
MAGIC = b"PDSKVT\x00\x01"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
RECORD = struct.Struct("<B7xQQQQ")
NO_PARENT_U64 = (1 << 64) - 1
"""valid, block hash, parent hash, checksum of the bytes, write sequence; then the block's token ids."""


def _align(n: int, to: int = 4096) -> int:
    return -(-n // to) * to


def _lock_a_file(directory: Path) -> tuple[Path, int]:
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(MAX_FILES):
        path = directory / f"kv_blocks.{i}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return path, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"{directory}: all {MAX_FILES} disk tier files are in use by other workers")


class DiskTier:
    medium = "disk"

    def __init__(self, directory: str, capacity_bytes: int, block_bytes: int, block_size: int,
                 layout_key: str) -> None:
        num_slots = capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"kv_offload_disk_gib holds no block: {capacity_bytes} bytes < {block_bytes} per block")
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.index = TierIndex(num_slots)
        self.record_bytes = RECORD.size + 8 * block_size
        self.data_offset = _align(HEADER_BYTES + num_slots * self.record_bytes)
        self.file_bytes = self.data_offset + num_slots * block_bytes
        self.header = json.dumps({"version": FORMAT_VERSION, "layout": layout_key, "block_bytes": block_bytes,
                                  "block_size": block_size, "slots": num_slots}, sort_keys=True).encode()
        self.path, self._fd = _lock_a_file(Path(directory))
        self.discarded = not self._header_matches()
        if self.discarded:
            if os.fstat(self._fd).st_size:
                logger.warning("discarding %s: written by another layout or format (never loaded)", self.path)
            os.ftruncate(self._fd, 0)
            os.ftruncate(self._fd, self.file_bytes)
        self._map = mmap.mmap(self._fd, self.file_bytes)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8, offset=self.data_offset,
                                     count=num_slots * block_bytes).view(num_slots, block_bytes)
        self._seq = 0
        if self.discarded:
            self._map[:HEADER_BYTES] = self._header_bytes()
        else:
            self._restore()

    @property
    def capacity_bytes(self) -> int:
        return self.index.num_slots * self.block_bytes

    def row(self, slot: int) -> torch.Tensor:
        return self.data[slot]

    # ---- engine thread ----------------------------------------------------
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _header_bytes(self) -> bytes:
        head = MAGIC + len(self.header).to_bytes(4, "little") + self.header
        return head.ljust(HEADER_BYTES, b"\x00")

    def _header_matches(self) -> bool:
        if os.fstat(self._fd).st_size != self.file_bytes:
            return False
        return os.pread(self._fd, HEADER_BYTES, 0) == self._header_bytes()

    def _restore(self) -> None:
        """Index the valid records of a file this layout wrote, oldest write first (LRU order)."""
        found = []
        for slot in range(self.index.num_slots):
            offset = HEADER_BYTES + slot * self.record_bytes
            valid, block_hash, parent, _, seq = RECORD.unpack_from(self._map, offset)
            if valid == 1:
                tokens = np.frombuffer(self._map, dtype=np.int64, count=self.block_size, offset=offset + RECORD.size)
                parent = NO_PARENT if parent == NO_PARENT_U64 else parent
                found.append((seq, slot, block_hash, parent, tuple(int(t) for t in tokens)))
        for seq, slot, block_hash, parent, tokens in sorted(found):
            if block_hash not in self.index:
                self.index.put(block_hash, parent, tokens, ready=True, slot=slot)
            self._seq = max(self._seq, seq)
        logger.info("disk tier %s: %d blocks found again", self.path, len(self.index))

    # ---- I/O thread -------------------------------------------------------
    def write(self, slot: int, block_hash: int, parent_hash: int, token_ids, seq: int, src: torch.Tensor) -> None:
        """Put a block's bytes (a host row) and its record in `slot`."""
        offset = HEADER_BYTES + slot * self.record_bytes
        self._map[offset] = 0
        row = self.data[slot]
        row.copy_(src)
        checksum = xxhash.xxh64(row.numpy()).intdigest()
        tokens = np.asarray(token_ids, dtype=np.int64).tobytes()
        self._map[offset + RECORD.size:offset + self.record_bytes] = tokens
        RECORD.pack_into(self._map, offset, 1, block_hash, parent_hash & NO_PARENT_U64, checksum, seq)

    def verify(self, slot: int, block_hash: int) -> bool:
        """True when the slot's record is valid for this hash and its bytes match their checksum."""
        valid, stored_hash, _, checksum, _ = RECORD.unpack_from(self._map, HEADER_BYTES + slot * self.record_bytes)
        if valid != 1 or stored_hash != block_hash:
            return False
        return xxhash.xxh64(self.data[slot].numpy()).intdigest() == checksum

    def invalidate(self, slot: int) -> None:
        self._map[HEADER_BYTES + slot * self.record_bytes] = 0

    def close(self) -> None:
        if self._fd < 0:
            return
        del self.data
        self._map.flush()
        try:
            self._map.close()
        except BufferError:  # a tensor view of a row is still alive: the mapping goes with it
            pass
        os.close(self._fd)
        self._fd = -1
