"""A small draft model of the target's vocabulary proposes ``k`` tokens by greedy decoding.

The simplest correct arrangement: each step the draft model recomputes each request's
whole sequence into a scratch KV cache of its own (contiguous blocks per request,
reused across steps), then decodes ``k - 1`` more tokens from it. Nothing of the
draft's KV survives a step, so rejected drafts, preemptions and prefix-cache hits of
the target need no bookkeeping here; the price is a prefill of the whole sequence by
the draft model each step, which is what a cached drafter (vLLM's draft-model or
EAGLE proposers, with KV slots reserved by ``num_lookahead_tokens``) would save.

Greedy drafts are a deterministic proposal (``q`` one-hot), which the rejection
sampler verifies exactly for greedy and random requests alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fastsched.attention import AttentionBackend, AttentionMetadata


class DraftModelProposer:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        num_speculative_tokens: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self._kv_caches: list[torch.Tensor] = []

    @torch.inference_mode()
    def propose(self, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``k`` greedy draft tokens (int64) for each token sequence."""
        if not sequences:
            return []
        bs = self.block_size
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        blocks_per_row = -(-(int(lengths.max()) + self.k) // bs)
        # Block 0 is the null block, as in the target's pool: row i owns a contiguous run after it.
        tables = 1 + np.arange(len(sequences) * blocks_per_row, dtype=np.int32).reshape(len(sequences), -1)
        self._ensure_blocks(1 + tables.size)

        # The whole sequences first: the last position's logits give the first draft.
        positions = np.concatenate([np.arange(n) for n in lengths.tolist()])
        rows = np.repeat(np.arange(len(sequences)), lengths)
        query_start = np.zeros(len(sequences) + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start[1:])
        tokens = self._forward(
            np.concatenate(sequences).astype(np.int64),
            positions,
            rows,
            tables,
            query_start,
            lengths,
            query_start[1:] - 1,
        )
        drafts = [tokens]
        one_each = np.arange(len(sequences) + 1, dtype=np.int32)
        every_row = np.arange(len(sequences))
        for step in range(self.k - 1):
            positions = lengths + step
            tokens = self._forward(tokens, positions, every_row, tables, one_each, positions + 1, None)
            drafts.append(tokens)
        return list(np.stack(drafts, axis=1))

    def _forward(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        rows: np.ndarray,
        tables: np.ndarray,
        query_start: np.ndarray,
        seq_lens: np.ndarray,
        logits_at: np.ndarray | None,
    ) -> np.ndarray:
        """One forward pass of the draft model; the argmax token at ``logits_at`` (every token when None)."""
        bs = self.block_size
        slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        metadata = AttentionMetadata(
            slot_mapping=put(slots),
            query_start_loc=put(query_start),
            seq_lens=put(seq_lens.astype(np.int32)),
            block_tables=put(tables),
            max_query_len=int(np.diff(query_start).max()),
            max_seq_len=int(seq_lens.max()),
        )
        self.backend.prepare(metadata)
        hidden = self.model(
            put(input_ids), put(positions.astype(np.int64)), self._kv_caches, metadata, self.backend
        )
        if logits_at is not None:
            hidden = hidden[put(logits_at.astype(np.int64))]
        return self.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()

    def _ensure_blocks(self, num_blocks: int) -> None:
        """Grows the scratch cache (doubling) to hold ``num_blocks`` blocks."""
        if self._kv_caches and self._kv_caches[0].shape[1] >= num_blocks:
            return
        num_blocks = max(num_blocks, 2 * (self._kv_caches[0].shape[1] if self._kv_caches else 0))
        cfg = self.model.config
        dtype = next(self.model.parameters()).dtype
        self._kv_caches = [
            torch.empty(
                2,
                num_blocks,
                self.block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                dtype=dtype,
                device=self.device,
            )
            for _ in range(cfg.num_layers)
        ]
