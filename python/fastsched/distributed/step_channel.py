"""How one step's model inputs reach the other tensor-parallel ranks, once per step.

The scheduler and the host preparation run on rank 0 only. What the other ranks need to
run the same forward pass is the step's index arrays, sent as three broadcasts: a fixed
header (command and sizes) and one int64 payload of every host array over the CPU (gloo)
group, then the input ids over the device group, after rank 0 has filled in the tokens its
previous step sampled (async scheduling; they exist only on rank 0's device). A broadcast
was chosen over a shared-memory ring (vLLM's MessageQueue) because it is the one transport
that also crosses machines; bench/RESULTS.md has its cost per step.

The same header carries the rarer commands that must reach the ranks in step order: a
weight reload (the checkpoint's path) and the KV connector's block copies (the block ids;
the blocks themselves then move in a gather or scatter, see ``ModelRunner.read_blocks``).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from fastsched.distributed.parallel import TensorParallel

STOP, STEP, RELOAD, READ_BLOCKS, WRITE_BLOCKS = 0, 1, 2, 3, 4
# How long rank 0 waits for the other ranks to load a reloaded checkpoint (a big one takes
# minutes, longer than the collectives' COLLECTIVE_TIMEOUT).
RELOAD_TIMEOUT = datetime.timedelta(minutes=30)
# command, T, B, max_blocks, max_query_len, max_seq_len, logits rows (-1: all), compute logits,
# LoRA plan length (-1: no adapter); other commands: command, payload length.
_HEADER = 9


@dataclass
class StepInputs:
    """What a forward pass reads besides the weights and the KV cache (``ModelRunner.execute``)."""

    input_ids: torch.Tensor  # [T] int64, on the device
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    logits_indices: np.ndarray | None  # rows whose logits are computed; None: every row
    compute_logits: bool  # False: no request samples, the step ends after the forward pass
    lora: np.ndarray | None = None  # rank 0's LoRA plan (fastsched.lora.step_wire); None: base model only


@dataclass
class Command:
    """A command other than a step: ``RELOAD`` (``path``) or a KV block copy (``block_ids``)."""

    kind: int
    path: str = ""
    block_ids: np.ndarray | None = None


class StepChannel:
    """Rank 0 :meth:`send`\\ s each step (and :meth:`send_stop` once); the others :meth:`receive`."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self._header = torch.zeros(_HEADER, dtype=torch.int64)
        self.bytes_sent = 0  # bytes broadcast so far (what the bench reports)
        # time.monotonic() since rank 0 has been in a step's (or command's) collectives; None between them.
        self.waiting_since: float | None = None
        self._pending: tuple[list[dist.Work], tuple[torch.Tensor, ...]] = ([], ())

    def send(self, step: StepInputs) -> None:
        self._wait_sent()  # the header buffer is reused
        t, b = len(step.positions), len(step.seq_lens)
        max_blocks = step.block_tables.shape[1] if step.block_tables.ndim == 2 else 0
        n_logits = -1 if step.logits_indices is None else len(step.logits_indices)
        n_lora = -1 if step.lora is None else len(step.lora)
        self._header.copy_(
            torch.tensor(
                [
                    STEP,
                    t,
                    b,
                    max_blocks,
                    step.max_query_len,
                    step.max_seq_len,
                    n_logits,
                    int(step.compute_logits),
                    n_lora,
                ]
            )
        )
        arrays = [
            step.positions,
            step.slot_mapping,
            step.query_start_loc,
            step.seq_lens,
            step.block_tables.ravel(),
        ]
        if step.logits_indices is not None:
            arrays.append(step.logits_indices)
        if step.lora is not None:
            arrays.append(step.lora)
        payload = torch.from_numpy(np.concatenate([a.astype(np.int64, copy=False) for a in arrays]))
        cpu = self.tp.cpu_group
        # Issued, not awaited: rank 0 starts its forward pass meanwhile, and its first
        # all-reduce meets the other ranks once they have the step. The tensors stay
        # referenced until the next send waits for these.
        self._pending = (
            [
                dist.broadcast(self._header, src=0, group=cpu, async_op=True),
                dist.broadcast(payload, src=0, group=cpu, async_op=True),
                dist.broadcast(step.input_ids, src=0, group=self.tp.group, async_op=True),
            ],
            (payload, step.input_ids),
        )
        self.bytes_sent += self._header.nbytes + payload.nbytes + step.input_ids.nbytes

    def _wait_sent(self) -> None:
        works, _ = self._pending
        for work in works:
            work.wait()
        self._pending = ([], ())

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Rank 0 runs collectives that need every rank: the hung-worker watch
        (``TensorParallelGroup``) times it."""
        self.waiting_since = time.monotonic()
        try:
            yield
        finally:
            self.waiting_since = None

    def send_stop(self) -> None:
        self._wait_sent()
        self._header.zero_()
        dist.broadcast(self._header, src=0, group=self.tp.cpu_group)

    def send_reload(self, path: str) -> None:
        """Every rank loads its shards of checkpoint ``path`` (a weight reload)."""
        text = path.encode()
        self.send_command(RELOAD, np.frombuffer(text + b"\0" * (-len(text) % 8), dtype=np.int64))

    def reload_vote(self, error: str | None) -> list[str | None]:
        """Every rank calls it once its shards of a reload are loaded and checked (``error``:
        why they are not) and gets every rank's answer, so that all copy them in or none does."""
        dist.monitored_barrier(group=self.tp.cpu_group, timeout=RELOAD_TIMEOUT)  # loading takes long
        errors: list[str | None] = [None] * self.tp.size
        dist.all_gather_object(errors, error, group=self.tp.cpu_group)
        return errors

    def reloaded(self) -> None:
        """Every rank calls it once its shards of a reload are in (or refused by a rank): rank 0
        returns when all have."""
        dist.monitored_barrier(group=self.tp.cpu_group, timeout=RELOAD_TIMEOUT)

    def send_command(self, kind: int, payload: np.ndarray) -> None:
        """A command (``RELOAD``, ``READ_BLOCKS``, ``WRITE_BLOCKS``) and its int64 payload,
        after the steps sent before it; the caller then runs the command's own collective."""
        self._wait_sent()
        data = torch.from_numpy(np.array(payload, dtype=np.int64))  # a copy: the payload may be read-only
        self._header.zero_()
        self._header[:2] = torch.tensor([kind, len(data)])
        dist.broadcast(self._header, src=0, group=self.tp.cpu_group)
        dist.broadcast(data, src=0, group=self.tp.cpu_group)
        self.bytes_sent += self._header.nbytes + data.nbytes

    def receive(self) -> StepInputs | Command | None:
        """The next step's inputs or command, or None when rank 0 stops the group."""
        header = self._header
        dist.broadcast(header, src=0, group=self.tp.cpu_group)
        command, t, b, max_blocks, max_query_len, max_seq_len, n_logits, logits, n_lora = header.tolist()
        if command == STOP:
            return None
        if command != STEP:
            data = torch.empty(t, dtype=torch.int64)
            dist.broadcast(data, src=0, group=self.tp.cpu_group)
            if command == RELOAD:
                return Command(command, path=data.numpy().tobytes().rstrip(b"\0").decode())
            return Command(command, block_ids=data.numpy())
        size = 2 * t + 2 * b + 1 + b * max_blocks + max(n_logits, 0) + max(n_lora, 0)
        payload = torch.empty(size, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.tp.cpu_group)
        input_ids = torch.empty(t, dtype=torch.int64, device=self.tp.device)
        dist.broadcast(input_ids, src=0, group=self.tp.group)
        bounds = np.cumsum([0, t, t, b + 1, b, b * max_blocks, max(n_logits, 0), max(n_lora, 0)])
        a = payload.numpy()
        parts = [a[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
        return StepInputs(
            input_ids=input_ids,
            positions=parts[0],
            slot_mapping=parts[1],
            query_start_loc=parts[2].astype(np.int32),
            seq_lens=parts[3].astype(np.int32),
            block_tables=parts[4].astype(np.int32).reshape(b, max_blocks),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            logits_indices=None if n_logits < 0 else parts[5],
            compute_logits=bool(logits),
            lora=None if n_lora < 0 else parts[6],
        )
