"""What a KV connector does, whatever its store: find, load and save full KV blocks.

Blocks are named by the scheduler's prefix-cache block hash (chained over the prompt
from the start, so a hash names a whole prefix; its root covers the LoRA adapter and the
request's ``cache_salt``), within a :class:`StoreIdentity` that says whose KV it is:
blocks of other weights, block size, dtype, layout or hash algorithm are never looked
at. A hash is only a name: a block is used only when the token ids stored with it are
the request's (:class:`BlockContents`), as the in-memory prefix cache confirms its hits.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StoreIdentity:
    """Whose blocks a store holds: two engines share blocks only when all of this matches."""

    model: str  # where the weights were read from, for people: not part of the key
    weights: str  # the weights' fingerprint (kv_connector.identity.weights_fingerprint)
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_algo: str  # --prefix-caching-hash-algo: how block hashes are computed

    @property
    def key(self) -> str:
        """A short stable name for this identity (a directory name); the same for copies of
        one checkpoint at different paths."""
        fields = {k: v for k, v in asdict(self).items() if k != "model"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's KV as the runner reads it: [layers, 2 (K, V), block_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class BlockContents:
    """Full blocks by hash, with what each holds: the hash of the block before it (0:
    unknown, the request's first block) and its token ids. A load's are what the blocks
    must hold to be used; a save's are stored beside their KV."""

    hashes: list[int]
    parents: list[int]
    tokens: np.ndarray  # [len(hashes), block_size] uint32


@dataclass
class BlockLoad:
    """A finished load: ``blocks`` holds the KV of the load's first ``len(blocks)``
    blocks, in order (fewer than asked: the next one was missing or corrupt)."""

    load_id: int
    handle: int
    block_ids: np.ndarray  # where the load goes, all of them
    blocks: torch.Tensor  # [num loaded, *block_shape] on the CPU
    seconds: float  # reading and checking them


@dataclass
class KVConnectorStats:
    """Counters since the engine started (``fastsched:kv_connector_*`` metrics)."""

    queries: int = 0  # requests looked up in the store
    hits: int = 0  # of them, those that found at least one block
    blocks_loaded: int = 0
    blocks_saved: int = 0
    load_failures: int = 0  # blocks found at lookup but missing, corrupt or not the request's when loaded
    token_mismatches: int = 0  # of them, blocks whose stored token ids (or parent) were not the request's
    load_timeouts: int = 0  # loads given up after load_timeout_s (their blocks computed instead)
    lookup_timeouts: int = 0  # lookups that took longer than lookup_timeout_s (taken as misses)
    blocks_evicted: int = 0  # block files deleted to keep the store under max_size
    saves_dropped: int = 0  # batches of blocks not saved: too many saves waiting for a slow store
    load_seconds: float = 0.0  # reading and checking loaded blocks (store side, background thread)
    save_seconds: float = 0.0  # writing saved blocks (background thread)

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


class KVConnector(ABC):
    """A store of full KV blocks. Lookups are synchronous and cheap (the scheduler needs
    the answer at admission); loads and saves run in the background."""

    def __init__(self, identity: StoreIdentity) -> None:
        self.identity = identity
        self.stats = KVConnectorStats()

    @abstractmethod
    def lookup(self, block_hashes: np.ndarray) -> int:
        """How many of the leading blocks ``block_hashes`` the store holds."""

    @abstractmethod
    def start_load(self, load_id: int, handle: int, block_ids: np.ndarray, blocks: BlockContents) -> None:
        """Starts reading these blocks; the result comes out of :meth:`finished_loads`."""

    @abstractmethod
    def finished_loads(self, wait: float = 0.0) -> list[BlockLoad]:
        """Loads finished since the last call; waits up to ``wait`` seconds for one when
        none has finished yet."""

    @abstractmethod
    def save(self, contents: BlockContents, blocks: torch.Tensor) -> None:
        """Stores these blocks' KV ([n, *block_shape] on the CPU) with what they hold, in
        the background; blocks already stored are left as they are."""

    @abstractmethod
    def close(self) -> None:
        """Waits for the saves in progress and stops the background work."""
