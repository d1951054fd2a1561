"""The runner's persistent per-request state: token ids, block tables and sampling parameters in rows.

A request gets a row when the scheduler reports it new or resumed and keeps it
until it is preempted or finished, so a decode step only appends one token and
perhaps one block id instead of resending the request.  Everything is a numpy
array indexed by row, which lets one step's inputs be gathered without a Python
loop over requests; Python runs per request only when a row changes hands.

A row's token count includes the tokens its steps in flight will sample: a step
reserves the position of each token it samples (:meth:`InputBatch.reserve`), and the
value is written when the step's result is in (:meth:`InputBatch.write_sampled`).
Under async scheduling the next step is prepared before that: its input at a
reserved position is a *placeholder*, which the runner fills from the previous
step's sampled tokens just before the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fastsched._core import KIND_CACHED, SchedulerOutput
from fastsched.sample import RowSamplingParams

if TYPE_CHECKING:
    import torch

    from fastsched.sampling_params import SamplingParams


@dataclass
class RowState:
    """What the runner needs of a request when it takes a row (the engine keeps it per request)."""

    params: SamplingParams
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)  # reserved positions included
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        # Rows of prefill-only requests (max_tokens 0, S20): they never sample.
        self.prefill_only = np.zeros(max_num_seqs, dtype=bool)
        # The one reserved position whose token a later step may need before it is written
        # (-1: none), and the index of that token among its step's sampled tokens.
        self.pending_pos = np.full(max_num_seqs, -1, dtype=np.int64)
        self.pending_index = np.zeros(max_num_seqs, dtype=np.int64)
        # Steps whose reserved positions are not all written yet: with none, no input is a
        # placeholder and the per-token check is skipped.
        self.num_unwritten_steps = 0
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.sampling = RowSamplingParams(max_num_seqs, vocab_size)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.row_of_handle = np.full(64, -1, dtype=np.int64)
        # Bumped when rows change hands, so a step can tell its rows are still its requests'.
        self.num_releases = 0

    def release(self, handles: np.ndarray) -> None:
        """Rows of preempted and finished requests become free."""
        if not len(handles):
            return
        handles = handles[handles < len(self.row_of_handle)]
        rows = self.row_of_handle[handles]
        held = rows >= 0
        for row in rows[held].tolist():
            self.sampling.clear_row(row)
        self._free_rows.extend(rows[held].tolist())
        self.row_of_handle[handles[held]] = -1
        self.num_releases += 1

    def update(
        self,
        so: SchedulerOutput,
        tokens_of: Callable[[int], np.ndarray],
        row_state_of: Callable[[int], RowState],
    ) -> np.ndarray:
        """Applies one step's new requests and block ids; returns each scheduled request's row.

        ``tokens_of(handle)`` is the full token sequence (prompt + outputs) of a request and
        ``row_state_of(handle)`` its sampling state; both are asked only for new and
        resumed requests.
        """
        if np.count_nonzero(so.kinds):  # rather than any(): see engine/core.py
            self._take_rows(so, tokens_of, row_state_of)
        rows = self.row_of_handle[so.req_handles]
        if len(so.block_ids):
            self._append_blocks(so, rows)
        return rows

    def _take_rows(
        self,
        so: SchedulerOutput,
        tokens_of: Callable[[int], np.ndarray],
        row_state_of: Callable[[int], RowState],
    ) -> None:
        """New and resumed requests take a free row: their tokens, sampling state and block table."""
        handles = so.req_handles
        if handles.max() >= len(self.row_of_handle):
            grown = np.full(2 * int(handles.max()) + 1, -1, dtype=np.int64)
            grown[: len(self.row_of_handle)] = self.row_of_handle
            self.row_of_handle = grown
        offsets = so.block_offsets
        for i in np.flatnonzero(so.kinds != KIND_CACHED).tolist():
            handle = int(handles[i])
            row = self._take_row(handle)
            self.row_of_handle[handle] = row
            tokens = tokens_of(handle)
            self.token_ids[row, : len(tokens)] = tokens
            self.num_tokens[row] = len(tokens)
            self.pending_pos[row] = -1
            state = row_state_of(handle)
            self.num_prompt_tokens[row] = state.num_prompt_tokens
            self.prefill_only[row] = state.params.max_tokens == 0
            self.sampling.set_row(row, state.params, state.eos_token_ids, state.generator)
            blocks = so.block_ids[offsets[i] : offsets[i + 1]]
            self.block_table[row, : len(blocks)] = blocks
            self.num_blocks[row] = len(blocks)

    def _take_row(self, handle: int) -> int:
        """A free row for ``handle``. A streaming session coming back for its next segment
        (S15) still holds its row: it moves to a fresh one when there is one, so that a write
        reserved for the old row by a step still in flight (async scheduling) misses it."""
        old = int(self.row_of_handle[handle])
        if old < 0:
            return self._free_rows.pop()
        if not self._free_rows:
            return old
        row = self._free_rows.pop()
        self.sampling.clear_row(old)
        self._free_rows.append(old)
        self.num_releases += 1
        return row

    def _append_blocks(self, so: SchedulerOutput, rows: np.ndarray) -> None:
        """Running rows append the blocks added this step, all rows at once."""
        offsets = so.block_offsets
        new_counts = offsets[1:].astype(np.int64) - offsets[:-1]
        new_counts[so.kinds != KIND_CACHED] = 0
        if np.count_nonzero(new_counts):
            grow = np.flatnonzero(new_counts)
            counts = new_counts[grow]
            starts = offsets[:-1][grow].astype(np.int64)
            first = np.repeat(np.cumsum(counts) - counts, counts)
            within = np.arange(int(counts.sum())) - first
            grow_rows = np.repeat(rows[grow], counts)
            self.block_table[grow_rows, self.num_blocks[grow_rows] + within] = so.block_ids[
                np.repeat(starts, counts) + within
            ]
            self.num_blocks[rows[grow]] += counts

    def reserve(self, rows: np.ndarray) -> Reservation:
        """Reserves the position of the token each of ``rows`` samples this step (the
        rows' order is the step's sampled order)."""
        positions = self.num_tokens[rows]
        self.num_tokens[rows] = positions + 1
        self.pending_pos[rows] = positions
        self.pending_index[rows] = np.arange(len(rows))
        self.num_unwritten_steps += 1
        return Reservation(rows, positions, self.num_releases)

    def write_sampled(self, handles: np.ndarray, reservation: Reservation, tokens: np.ndarray) -> None:
        """Writes a step's sampled tokens (of requests ``handles``) at the positions it
        reserved, for the rows still held by the request they were reserved for (a
        request preempted or finished since then has given its row up, perhaps to another
        request). Steps are written in the order they reserved."""
        rows, positions = reservation.rows, reservation.positions
        self.num_unwritten_steps -= 1
        if self.num_releases != reservation.num_releases:
            held = self.row_of_handle[handles] == rows
            rows, positions, tokens = rows[held], positions[held], tokens[held]
        self.token_ids[rows, positions] = tokens
        if self.num_unwritten_steps:
            # A later step reserved again: only positions not reserved since are done.
            rows = rows[self.pending_pos[rows] == positions]
        self.pending_pos[rows] = -1

    def write_accepted(self, reservation: Reservation, counts: np.ndarray, tokens: np.ndarray) -> None:
        """A verification step's tokens (speculative decoding, synchronous): row ``i`` of the
        reservation got ``counts[i]`` tokens, its accepted drafts and its own, from its reserved
        position on. No row changed hands since the step was prepared (no step ran between)."""
        rows, positions = reservation.rows, reservation.positions
        self.num_unwritten_steps -= 1
        within = np.arange(len(tokens)) - np.repeat(np.cumsum(counts) - counts, counts)
        self.token_ids[np.repeat(rows, counts), np.repeat(positions, counts) + within] = tokens
        self.num_tokens[rows] = positions + counts
        self.pending_pos[rows] = -1


@dataclass
class Reservation:
    """The positions a step reserved for its sampled tokens (:meth:`InputBatch.reserve`)."""

    rows: np.ndarray
    positions: np.ndarray
    num_releases: int  # InputBatch.num_releases then
