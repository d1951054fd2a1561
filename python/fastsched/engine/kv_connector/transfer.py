"""The engine's side of a KV connector: the S7 ``remote_kv`` handshake with the scheduler.

1. A request arrives: the store is asked how many of its leading prompt blocks it holds
   (:meth:`KVTransfer.on_add`); the scheduler is told (``set_external_tokens``).
2. At admission the scheduler takes the blocks past the local prefix-cache hit, allocates
   the whole prompt, starts a load and skips the request (``remote_kv``) until it is
   reported; :meth:`after_schedule` hands each started load to the store's threads.
3. Before each schedule, :meth:`before_schedule` copies the finished loads into the KV
   cache and reports them (a short or failed load: the rest is computed).
4. Blocks that became full in a step are read out once the step's forward pass has written
   them and handed to the store (:meth:`save`).

The KV cache is written and read in forward-pass order (``ordered``: the forward thread
under async scheduling), so a copy never races a step that reuses the same blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from fastsched import _core
from fastsched.engine.kv_connector.base import BlockContents, KVConnector, StoreIdentity
from fastsched.engine.kv_connector.shared_storage import SharedStorageConnector
from fastsched.kv_transfer import KVTransferConfig

if TYPE_CHECKING:
    from fastsched.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How long an engine with nothing but loads in progress waits for one to finish per step
# (instead of spinning on empty steps).
IDLE_WAIT_S = 0.05

Saves = tuple[np.ndarray, BlockContents]  # block ids, what they hold
Ordered = Callable[[Callable[[], Any]], "Future[Any] | None"]


def make_connector(config: KVTransferConfig, identity: StoreIdentity) -> KVConnector:
    if config.kv_connector == "SharedStorageConnector":
        return SharedStorageConnector(
            identity,
            config.shared_storage_path,
            max_size=config.max_size,
            load_timeout_s=config.load_timeout_s,
            lookup_timeout_s=config.lookup_timeout_s,
        )
    raise ValueError(f"kv_transfer_config.kv_connector {config.kv_connector!r} is not implemented")


class KVTransfer:
    def __init__(
        self,
        config: KVTransferConfig,
        connector: KVConnector,
        scheduler: _core.Scheduler,
        runner: ModelRunner,
        ordered: Ordered,
    ) -> None:
        self.config = config
        self.connector = connector
        self._scheduler = scheduler
        self._runner = runner
        self._ordered = ordered
        self._block_size = connector.identity.block_size
        self._num_loading = 0  # loads handed to the store and not yet finished
        self._copies: list[Future[Any]] = []  # copies into the KV cache queued on the forward thread
        scheduler.use_engine_connector()

    @property
    def stats(self) -> dict[str, float]:
        return self.connector.stats.as_dict()

    def on_add(self, handle: int, lora_id: int | None) -> None:
        """Tells the scheduler how much of the new request's prompt the store holds. Requests
        with a LoRA adapter do not use the store (the scheduler does not list their blocks for
        saving either): their block hashes chain from the adapter's numeric id, which another
        engine, or this one after a restart, may give to another adapter."""
        if not self.config.is_consumer or lora_id is not None:
            return
        num_blocks = self.connector.lookup(self._scheduler.block_hashes(handle))
        if num_blocks:
            self._scheduler.set_external_tokens(handle, num_blocks * self._block_size)

    def before_schedule(self) -> None:
        """Copies finished loads into the KV cache and reports them to the scheduler."""
        self._copies = [f for f in self._copies if not _done(f)]
        s = self._scheduler
        idle = self._num_loading and s.num_running == 0 and s.num_waiting <= self._num_loading
        for load in self.connector.finished_loads(IDLE_WAIT_S if idle else 0.0):
            self._num_loading -= 1
            n = len(load.blocks)
            if not self._scheduler.finish_kv_load(load.handle, load.load_id, n) or not n:
                continue  # aborted meanwhile (its blocks may be someone else's now), or nothing loaded
            copy = self._ordered(partial(self._runner.write_blocks, load.block_ids[:n], load.blocks))
            if copy is not None:
                self._copies.append(copy)

    def after_schedule(self) -> Saves | None:
        """Starts the loads the schedule began; returns the step's blocks to save, if any."""
        for load_id, handle, block_ids, block_hashes in self._scheduler.take_kv_loads():
            self._num_loading += 1
            self.connector.start_load(load_id, handle, block_ids, self._expected(handle, block_hashes))
        block_ids, block_hashes = self._scheduler.take_cached_blocks()
        if not len(block_ids) or not self.config.is_producer:
            return None
        parents, tokens = self._scheduler.cached_block_contents(block_ids)
        return block_ids, BlockContents(
            block_hashes.tolist(), parents.tolist(), tokens.reshape(len(block_ids), self._block_size)
        )

    def _expected(self, handle: int, load_hashes: np.ndarray) -> BlockContents:
        """What the blocks of a load must hold: the request's tokens of those blocks, and the
        hash of the block before each (unknown, 0, before the first block of the prompt)."""
        hashes = self._scheduler.block_hashes(handle)
        first = int(np.flatnonzero(hashes == load_hashes[0])[0])
        n, bs = len(load_hashes), self._block_size
        tokens = self._scheduler.token_ids(handle)[first * bs : (first + n) * bs].reshape(n, bs)
        parents = [int(hashes[first - 1]) if first else 0, *load_hashes[:-1].tolist()]
        return BlockContents(load_hashes.tolist(), parents, tokens)

    def save(self, saves: Saves) -> None:
        """Reads the blocks out of the KV cache (after the forward pass that wrote them) and
        hands them to the store. Best effort: a failure loses a store entry, not a request."""
        block_ids, contents = saves
        try:
            self.connector.save(contents, self._runner.read_blocks(block_ids))
        except Exception:
            logger.exception("saving %d KV blocks failed", len(block_ids))

    def close(self) -> None:
        """Waits for the saves in progress (a restarted engine finds every block saved)."""
        self.connector.close()


def _done(copy: Future[Any]) -> bool:
    """A finished copy into the KV cache; its error, if any, is raised (a block left half
    written would be read as computed)."""
    if not copy.done():
        return False
    copy.result()
    return True
