"""``SharedStorageConnector``: one file per full KV block on a filesystem that several
engines (the D engines of a server, several servers, an engine and its restart) share.

Layout: ``<shared_storage_path>/<identity key>/<2 hex>/<block hash as 16 hex>.kv``, with
``identity.json`` beside the blocks saying whose they are (:class:`StoreIdentity`). A file
is a fixed header (magic, identity key, block hash, parent hash, token count, payload
length, CRC-32 of tokens and payload), the block's token ids, then its KV in the engine's
dtype.

What the store trusts, and why:

- Only its owner reads or writes it: the identity directory and its subdirectories are
  0700 and files 0600; files are created with ``O_EXCL|O_NOFOLLOW`` under an
  unpredictable temporary name and renamed into place (a reader sees a whole file or
  none), and read with ``O_NOFOLLOW`` (a symlink planted in the store is not followed).
- A hash is a name, not proof: a block is used only if its stored token ids (and parent
  hash, where the request's is known) are the request's; a mismatch is a miss, counted
  (``token_mismatches``). A truncated or corrupt file fails its checks, is deleted and
  computed again.
- It is bounded: past ``max_size`` bytes the least recently used block files (by
  modification time, which a load refreshes) are deleted down to 90% of it; a load is
  given up after ``load_timeout_s`` and a lookup after ``lookup_timeout_s`` (a hung
  network filesystem costs computation, never a stuck engine); at most
  :data:`MAX_PENDING_SAVES` saves wait in memory; a file is read only when its size is
  exactly a block file's.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import stat
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from fastsched.engine.kv_connector.base import BlockContents, BlockLoad, KVConnector, StoreIdentity

logger = logging.getLogger(__name__)

MAGIC = b"FSKVBLK2"
# magic, identity key, block hash, parent hash, token count, payload bytes, CRC-32 of tokens + payload
_HEADER = struct.Struct("<8s16sQQIQI")
# Loads read files in parallel (a network filesystem answers slowly, not one at a time).
NUM_LOAD_THREADS = 2
DIR_MODE = 0o700
FILE_MODE = 0o600
# Eviction deletes down to this fraction of max_size, so that it runs once per tenth of it written.
EVICT_TO = 0.9
# A temporary file this old is left over from a writer that died; eviction deletes it.
STALE_TMP_S = 600.0
# Saves waiting for the save thread (each holds its blocks' KV in memory); past this, a slow
# store loses saves instead of growing the engine's memory.
MAX_PENDING_SAVES = 64
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class CorruptBlockError(ValueError):
    """A block file that fails its checks."""


class MismatchedBlockError(ValueError):
    """A sound block file that holds other tokens than the request's (a hash collision or
    a forged file): a miss, and the file is left to whoever it belongs to."""


@dataclass
class _Pending:
    handle: int
    block_ids: np.ndarray
    deadline: float  # time.monotonic()


class SharedStorageConnector(KVConnector):
    def __init__(
        self,
        identity: StoreIdentity,
        shared_storage_path: str | os.PathLike[str],
        *,
        max_size: int,
        load_timeout_s: float,
        lookup_timeout_s: float,
    ) -> None:
        super().__init__(identity)
        base = Path(shared_storage_path)
        if not base.exists():
            base.mkdir(mode=DIR_MODE, parents=True)
        self.root = base / identity.key
        _private_dir(self.root)
        _write_identity(self.root / "identity.json", identity)
        self.max_size = max_size
        self.load_timeout_s = load_timeout_s
        self.lookup_timeout_s = lookup_timeout_s
        self._key = identity.key.encode()
        self._num_tokens = identity.block_size
        self._block_bytes = (
            int(np.prod(identity.block_shape)) * torch.empty((), dtype=identity.torch_dtype).element_size()
        )
        self.file_bytes = _HEADER.size + 4 * self._num_tokens + self._block_bytes
        self._loads = ThreadPoolExecutor(NUM_LOAD_THREADS, thread_name_prefix="fastsched-kv-load")
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="fastsched-kv-lookup")
        self._saves = ThreadPoolExecutor(1, thread_name_prefix="fastsched-kv-save")
        self._done: queue.Queue[BlockLoad] = queue.Queue()
        self._lock = threading.Lock()  # the counters and the loads in progress, shared with the threads
        self._pending: dict[int, _Pending] = {}
        self._lookup: Future[int] | None = None  # the last lookup, which may still hang
        self._num_saves = 0  # saves submitted and not yet done
        self._dirs: set[Path] = set()  # subdirectories known to be private
        self._size = self._scan()[0]  # bytes of block files, as of the last scan plus what was saved since

    def path_of(self, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self.root / name[:2] / f"{name}.kv"

    # ------------------------------------------------------------ lookup and load

    def lookup(self, block_hashes: np.ndarray) -> int:
        """Waits at most ``lookup_timeout_s``, and not at all while an earlier lookup still
        hangs (the engine's loop must not stall once per request on a dead store)."""
        n = 0
        if self._lookup is not None and not self._lookup.done():
            with self._lock:
                self.stats.lookup_timeouts += 1
        else:
            self._lookup = self._lookups.submit(self._count_present, block_hashes.tolist())
            try:
                n = self._lookup.result(timeout=self.lookup_timeout_s)
            except FutureTimeout:
                logger.warning(
                    "KV store lookup took more than %.3gs (lookup_timeout_s); computing the prompt",
                    self.lookup_timeout_s,
                )
                with self._lock:
                    self.stats.lookup_timeouts += 1
        with self._lock:
            self.stats.queries += 1
            self.stats.hits += n > 0
        return n

    def _count_present(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            try:
                st = os.lstat(self.path_of(h))
            except OSError:
                break
            if not stat.S_ISREG(st.st_mode):
                break
            n += 1
        return n

    def start_load(self, load_id: int, handle: int, block_ids: np.ndarray, blocks: BlockContents) -> None:
        deadline = time.monotonic() + self.load_timeout_s
        with self._lock:
            self._pending[load_id] = _Pending(handle, block_ids, deadline)
        self._loads.submit(self._load, load_id, handle, block_ids, blocks, deadline)

    def finished_loads(self, wait: float = 0.0) -> list[BlockLoad]:
        done = []
        try:
            done.append(self._done.get(timeout=wait) if wait > 0 else self._done.get_nowait())
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return done + self._expire()

    def _expire(self) -> list[BlockLoad]:
        """Loads past their deadline, given up: reported with no block (all computed); their
        reading threads' results, whenever they come, are dropped."""
        now = time.monotonic()
        with self._lock:
            late = [load_id for load_id, p in self._pending.items() if p.deadline <= now]
            expired = [(load_id, self._pending.pop(load_id)) for load_id in late]
            self.stats.load_timeouts += len(expired)
        if expired:
            logger.warning(
                "KV store loads %s took more than %.3gs (load_timeout_s); computing their blocks",
                late,
                self.load_timeout_s,
            )
        empty = torch.empty((0, *self.identity.block_shape), dtype=self.identity.torch_dtype)
        return [
            BlockLoad(load_id, p.handle, p.block_ids, empty, self.load_timeout_s) for load_id, p in expired
        ]

    def _load(
        self, load_id: int, handle: int, block_ids: np.ndarray, expected: BlockContents, deadline: float
    ) -> None:
        start = time.perf_counter()
        blocks: list[torch.Tensor] = []
        mismatched = 0
        try:
            for i, h in enumerate(expected.hashes):
                if time.monotonic() >= deadline:
                    break
                path = self.path_of(h)
                try:
                    blocks.append(self._read_block(path, h, expected.parents[i], expected.tokens[i]))
                except MismatchedBlockError as e:
                    logger.warning("KV block %s is not this request's, computing it instead: %s", path, e)
                    mismatched = 1
                    break
                except (OSError, CorruptBlockError) as e:
                    logger.warning("KV block %s unusable, computing it instead: %s", path, e)
                    if isinstance(e, CorruptBlockError):
                        path.unlink(missing_ok=True)  # so that the recomputed block is saved again
                    break
                _touch(path)  # recently used: the last to be evicted
        except Exception:
            logger.exception("reading KV blocks failed; the rest of the load is computed")
        finally:
            # Whatever happened, the load is reported (short), or its request would wait forever.
            seconds = time.perf_counter() - start
            shape = (len(blocks), *self.identity.block_shape)
            data = torch.stack(blocks) if blocks else torch.empty(shape, dtype=self.identity.torch_dtype)
            with self._lock:
                live = self._pending.pop(load_id, None) is not None
                self.stats.load_seconds += seconds
                if live:  # else given up already (_expire) and counted as a timeout
                    self.stats.blocks_loaded += len(blocks)
                    self.stats.load_failures += len(expected.hashes) - len(blocks)
                    self.stats.token_mismatches += mismatched
            if live:
                self._done.put(BlockLoad(load_id, handle, block_ids, data, seconds))

    def _read_block(self, path: Path, block_hash: int, parent: int, tokens: np.ndarray) -> torch.Tensor:
        data = _read_exactly(path, self.file_bytes)
        magic, key, stored_hash, stored_parent, num_tokens, nbytes, crc = _HEADER.unpack_from(data)
        body = memoryview(data)[_HEADER.size :]
        if magic != MAGIC:
            raise CorruptBlockError(f"not a KV block file (magic {magic!r})")
        if key != self._key or stored_hash != block_hash:
            raise CorruptBlockError(f"holds block {stored_hash:016x} of store {key!r}, not {block_hash:016x}")
        if num_tokens != self._num_tokens or nbytes != self._block_bytes:
            raise CorruptBlockError(
                f"holds {num_tokens} tokens and {nbytes} bytes of KV, expected "
                f"{self._num_tokens} and {self._block_bytes}"
            )
        if zlib.crc32(body) != crc:
            raise CorruptBlockError("checksum mismatch")
        stored_tokens = np.frombuffer(body[: 4 * num_tokens], dtype="<u4")
        if not np.array_equal(stored_tokens, tokens):
            raise MismatchedBlockError("its token ids differ from the request's")
        if parent and stored_parent != parent:
            raise MismatchedBlockError(f"it follows block {stored_parent:016x}, the request's {parent:016x}")
        flat = torch.frombuffer(bytearray(body[4 * num_tokens :]), dtype=torch.uint8)
        return flat.view(self.identity.torch_dtype).reshape(self.identity.block_shape)

    # ------------------------------------------------------------ save

    def save(self, contents: BlockContents, blocks: torch.Tensor) -> None:
        with self._lock:
            if self._num_saves >= MAX_PENDING_SAVES:
                self.stats.saves_dropped += 1
                return
            self._num_saves += 1
        self._saves.submit(self._save, contents, blocks)

    def _save(self, contents: BlockContents, blocks: torch.Tensor) -> None:
        try:
            self._save_blocks(contents, blocks)
        finally:
            with self._lock:
                self._num_saves -= 1

    def _save_blocks(self, contents: BlockContents, blocks: torch.Tensor) -> None:
        start = time.perf_counter()
        saved = 0
        for i, (h, block) in enumerate(zip(contents.hashes, blocks)):
            path = self.path_of(h)
            if os.path.lexists(path):
                continue
            try:
                self._write_block(path, h, contents.parents[i], contents.tokens[i], block)
                saved += 1
            except OSError as e:
                logger.warning("could not save KV block %s: %s", path, e)
        evicted = 0
        if saved:
            self._size += saved * self.file_bytes
            if self._size > self.max_size:
                evicted = self._evict()
        with self._lock:
            self.stats.blocks_saved += saved
            self.stats.blocks_evicted += evicted
            self.stats.save_seconds += time.perf_counter() - start

    def _write_block(
        self, path: Path, block_hash: int, parent: int, tokens: np.ndarray, block: torch.Tensor
    ) -> None:
        token_bytes = np.ascontiguousarray(tokens, dtype="<u4").tobytes()
        payload = block.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        crc = zlib.crc32(payload, zlib.crc32(token_bytes))
        header = _HEADER.pack(MAGIC, self._key, block_hash, parent, len(tokens), len(payload), crc)
        if path.parent not in self._dirs:
            _private_dir(path.parent)
            self._dirs.add(path.parent)
        _write_file(path, header + token_bytes + payload)

    # ------------------------------------------------------------ size

    def _scan(self) -> tuple[int, list[tuple[float, int, Path]]]:
        """The bytes of block files in the store (every engine's) and the files, oldest
        first; leftover temporary files of dead writers are deleted."""
        total, files = 0, []
        now = time.time()
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # deleted meanwhile
                if entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
                elif entry.name.endswith(".kv") and stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    files.append((st.st_mtime, st.st_size, Path(entry.path)))
        files.sort()
        return total, files

    def _evict(self) -> int:
        """Deletes the least recently used block files until the store is under
        ``EVICT_TO * max_size``; returns how many."""
        total, files = self._scan()
        target = EVICT_TO * self.max_size
        evicted = 0
        for _, size, path in files:
            if total <= target:
                break
            path.unlink(missing_ok=True)
            total -= size
            evicted += 1
        self._size = total
        if evicted:
            logger.info(
                "KV store over max_size (%d bytes): deleted the %d least recently used blocks",
                self.max_size,
                evicted,
            )
        return evicted

    def close(self) -> None:
        self._saves.shutdown(wait=True)
        self._loads.shutdown(wait=True, cancel_futures=True)
        self._lookups.shutdown(wait=False, cancel_futures=True)


def _private_dir(path: Path) -> None:
    """``path`` as a directory only its owner can use: created 0700, or checked to be a real
    directory (not a symlink) owned by this user, and made 0700."""
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"KV store directory {path} is not a directory (a symlink or a file)")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise ValueError(
            f"KV store directory {path} belongs to user {st.st_uid}, not to this one "
            f"({os.geteuid()}): its blocks cannot be trusted"
        )
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)


def _write_file(path: Path, data: bytes) -> None:
    """Writes ``data`` whole under a fresh unpredictable name (``O_EXCL|O_NOFOLLOW``, 0600)
    and renames it to ``path``: readers see the whole file or none."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, _CREATE, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_exactly(path: Path, size: int) -> bytes:
    """The file's ``size`` bytes, read without following a symlink; a file of another size
    is corrupt (never read whole: the read is bounded by what a block file holds)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CorruptBlockError("not a regular file")
        if st.st_size != size:
            raise CorruptBlockError(f"{st.st_size} bytes, expected {size}")
        data = f.read(size)
    if len(data) != size:
        raise CorruptBlockError(f"truncated while read: {len(data)} of {size} bytes")
    return data


def _touch(path: Path) -> None:
    try:
        os.utime(path, follow_symlinks=False)
    except OSError:
        pass  # deleted meanwhile: nothing to keep


def _write_identity(path: Path, identity: StoreIdentity) -> None:
    """``identity.json``, for a person looking at the store (the directory name is its hash)."""
    if not path.exists():
        _write_file(path, (json.dumps(asdict(identity), indent=2, sort_keys=True) + "\n").encode())
