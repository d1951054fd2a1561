"""The runner's persistent per-request state: token ids and block tables in rows.

A request gets a row when the scheduler reports it new or resumed and keeps it
until it is preempted or finished, so a decode step only appends one token and
perhaps one block id instead of resending the request.  Everything is a numpy
array indexed by row, which lets one step's inputs be gathered without a Python
loop over requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fastsched._core import KIND_CACHED, SchedulerOutput


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.row_of_handle = np.full(64, -1, dtype=np.int64)

    def release(self, handles: np.ndarray) -> None:
        """Rows of preempted and finished requests become free."""
        for h in handles.tolist():
            if h < len(self.row_of_handle) and (row := self.row_of_handle[h]) >= 0:
                self._free_rows.append(int(row))
                self.row_of_handle[h] = -1

    def update(self, so: SchedulerOutput, tokens_of: Callable[[int], Sequence[int]]) -> np.ndarray:
        """Applies one step's new requests and block ids; returns each scheduled request's row.

        ``tokens_of(handle)`` is the full token sequence (prompt + outputs) of a
        request; it is asked only for new and resumed requests.
        """
        handles = so.req_handles
        if len(handles) and handles.max() >= len(self.row_of_handle):
            grown = np.full(2 * int(handles.max()) + 1, -1, dtype=np.int64)
            grown[: len(self.row_of_handle)] = self.row_of_handle
            self.row_of_handle = grown
        offsets = so.block_offsets
        for i in np.flatnonzero(so.kinds != KIND_CACHED).tolist():
            row = self._free_rows.pop()
            self.row_of_handle[handles[i]] = row
            tokens = tokens_of(int(handles[i]))
            self.token_ids[row, : len(tokens)] = tokens
            self.num_tokens[row] = len(tokens)
            blocks = so.block_ids[offsets[i] : offsets[i + 1]]
            self.block_table[row, : len(blocks)] = blocks
            self.num_blocks[row] = len(blocks)
        rows = self.row_of_handle[handles]
        new_counts = np.diff(offsets.astype(np.int64))
        grow = np.flatnonzero((so.kinds == KIND_CACHED) & (new_counts > 0))
        for i in grow.tolist():
            row = rows[i]
            start = self.num_blocks[row]
            self.block_table[row, start : start + new_counts[i]] = so.block_ids[offsets[i] : offsets[i + 1]]
            self.num_blocks[row] = start + new_counts[i]
        return rows

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Appends one sampled token to each of ``rows``."""
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1
