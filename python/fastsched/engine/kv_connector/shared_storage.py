"""``SharedStorageConnector``: one file per full KV block on a filesystem that several
engines (the D engines of a server, several servers, an engine and its restart) share.

Layout: ``<shared_storage_path>/<identity key>/<2 hex>/<block hash as 16 hex>.kv``, with
``identity.json`` beside the blocks saying whose they are (:class:`StoreIdentity`). A file
is a fixed header (magic, identity key, block hash, payload length, CRC-32 of the
payload) followed by the block's KV in the engine's dtype. Files are written whole under
a temporary name and renamed into place, so a reader sees a complete file or none; a file
that is truncated or corrupt anyway (a disk, a copy, another writer) fails its checks,
is logged, deleted and treated as a miss, and the block is computed again.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from fastsched.engine.kv_connector.base import BlockLoad, KVConnector, StoreIdentity

logger = logging.getLogger(__name__)

MAGIC = b"FSKVBLK1"
_HEADER = struct.Struct("<8s16sQQI")  # magic, identity key, block hash, payload bytes, CRC-32
# Loads read files in parallel (a network filesystem answers slowly, not one at a time).
NUM_LOAD_THREADS = 2


class CorruptBlockError(ValueError):
    """A block file that fails its checks."""


class SharedStorageConnector(KVConnector):
    def __init__(self, identity: StoreIdentity, shared_storage_path: str | os.PathLike[str]) -> None:
        super().__init__(identity)
        self.root = Path(shared_storage_path) / identity.key
        self.root.mkdir(parents=True, exist_ok=True)
        _write_identity(self.root / "identity.json", identity)
        self._key = identity.key.encode()
        self._block_bytes = int(np.prod(identity.block_shape)) * torch.empty((), dtype=identity.torch_dtype).element_size()
        self._loads = ThreadPoolExecutor(NUM_LOAD_THREADS, thread_name_prefix="fastsched-kv-load")
        self._saves = ThreadPoolExecutor(1, thread_name_prefix="fastsched-kv-save")
        self._done: queue.Queue[BlockLoad] = queue.Queue()
        self._stats_lock = threading.Lock()  # the counters are updated by the background threads

    def path_of(self, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self.root / name[:2] / f"{name}.kv"

    # ------------------------------------------------------------ lookup and load

    def lookup(self, block_hashes: np.ndarray) -> int:
        n = 0
        for h in block_hashes.tolist():
            if not self.path_of(h).is_file():
                break
            n += 1
        self.stats.queries += 1
        self.stats.hits += n > 0
        return n

    def start_load(self, load_id: int, handle: int, block_ids: np.ndarray, block_hashes: np.ndarray) -> None:
        self._loads.submit(self._load, load_id, handle, block_ids, block_hashes.tolist())

    def finished_loads(self, wait: float = 0.0) -> list[BlockLoad]:
        done = []
        try:
            done.append(self._done.get(timeout=wait) if wait > 0 else self._done.get_nowait())
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return done

    def _load(self, load_id: int, handle: int, block_ids: np.ndarray, hashes: list[int]) -> None:
        start = time.perf_counter()
        blocks = []
        try:
            for h in hashes:
                path = self.path_of(h)
                try:
                    blocks.append(self._read_block(path, h))
                except (OSError, CorruptBlockError) as e:
                    logger.warning("KV block %s unusable, computing it instead: %s", path, e)
                    if isinstance(e, CorruptBlockError):
                        path.unlink(missing_ok=True)  # so that the recomputed block is saved again
                    break
        finally:
            # Even a bug in a read reports the load (as failed), or its request would wait forever.
            seconds = time.perf_counter() - start
            shape = (len(blocks), *self.identity.block_shape)
            data = torch.stack(blocks) if blocks else torch.empty(shape, dtype=self.identity.torch_dtype)
            with self._stats_lock:
                self.stats.blocks_loaded += len(blocks)
                self.stats.load_failures += len(hashes) - len(blocks)
                self.stats.load_seconds += seconds
            self._done.put(BlockLoad(load_id, handle, block_ids, data, seconds))

    def _read_block(self, path: Path, block_hash: int) -> torch.Tensor:
        data = path.read_bytes()
        if len(data) < _HEADER.size:
            raise CorruptBlockError(f"truncated: {len(data)} bytes, less than its header")
        magic, key, stored_hash, nbytes, crc = _HEADER.unpack_from(data)
        payload = memoryview(data)[_HEADER.size :]
        if magic != MAGIC:
            raise CorruptBlockError(f"not a KV block file (magic {magic!r})")
        if key != self._key or stored_hash != block_hash:
            raise CorruptBlockError(f"holds block {stored_hash:016x} of store {key!r}, not {block_hash:016x}")
        if nbytes != self._block_bytes or len(payload) != nbytes:
            raise CorruptBlockError(f"payload of {len(payload)} bytes (header: {nbytes}), "
                                    f"expected {self._block_bytes}")
        if zlib.crc32(payload) != crc:
            raise CorruptBlockError("checksum mismatch")
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.identity.torch_dtype).reshape(self.identity.block_shape)

    # ------------------------------------------------------------ save

    def save(self, block_hashes: np.ndarray, blocks: torch.Tensor) -> None:
        self._saves.submit(self._save, block_hashes.tolist(), blocks)

    def _save(self, hashes: list[int], blocks: torch.Tensor) -> None:
        start = time.perf_counter()
        saved = 0
        for h, block in zip(hashes, blocks):
            path = self.path_of(h)
            if path.exists():
                continue
            try:
                self._write_block(path, h, block)
                saved += 1
            except OSError as e:
                logger.warning("could not save KV block %s: %s", path, e)
        with self._stats_lock:
            self.stats.blocks_saved += saved
            self.stats.save_seconds += time.perf_counter() - start

    def _write_block(self, path: Path, block_hash: int, block: torch.Tensor) -> None:
        payload = block.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(MAGIC, self._key, block_hash, len(payload), zlib.crc32(payload))
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)  # atomic: readers see the whole file or none

    def close(self) -> None:
        self._saves.shutdown(wait=True)
        self._loads.shutdown(wait=True, cancel_futures=True)


def _write_identity(path: Path, identity: StoreIdentity) -> None:
    """``identity.json``, for a person looking at the store (the directory name is its hash)."""
    if not path.exists():
        tmp = path.with_name(f".identity.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(identity), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
