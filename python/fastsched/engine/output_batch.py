"""One engine step's outputs as columns (:class:`OutputBatch`), and one request's delta
(:class:`EngineCoreOutput`): what :mod:`fastsched.engine.protocol` carries in an OUTPUTS message."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from fastsched._core import FINISH_REASONS

FINISH_CODES = {reason: code for code, reason in FINISH_REASONS.items()}


@dataclass
class EngineCoreOutput:
    """What one step produced for one request (a delta)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | ignored
    stop_reason: int | str | None = None  # the stop token id that ended it
    new_logprobs: list[dict[int, tuple[float, int]]] | None = None  # per token: id -> (logprob, rank)
    num_cached_tokens: int | None = None
    error: str | None = None  # why an ignored request could not run
    segment_ended: bool = False  # a streaming session ended a segment: it waits for input (S15)
    pooled: np.ndarray | None = None  # a pooling request's embedding (float32), with its prompt's last step
    # With the first token (or a prefill-only finish): per prompt token, None for the first.
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None


_Logprobs = list[dict[int, tuple[float, int]]]
_PromptLogprobs = list[dict[int, tuple[float, int]] | None]


@dataclass(eq=False)
class OutputBatch:
    """One engine step's outputs as columns: row ``i`` is one request's delta.

    The engine fills it from the scheduler's arrays without a Python object per row;
    rows that need more than the columns (a stop token id, logprobs, an error, an embedding) are the
    few keys of the sparse maps. Iterating gives one :class:`EngineCoreOutput` per row,
    for in-process consumers; :func:`encode` packs the columns as bytes.
    """

    request_ids: list[str]
    token_offsets: np.ndarray  # [n + 1], CSR into token_ids
    token_ids: np.ndarray  # new tokens of all rows
    finish_reasons: np.ndarray  # [n] uint8: 0 still running, else a key of FINISH_REASONS
    num_cached_tokens: np.ndarray  # [n] int64: the prefix-cache hit, reported once; -1 = nothing
    first_token: np.ndarray  # [n] bool: the request's first token is in this delta (engine side only)
    clients: np.ndarray  # [n] int: the frontend the request came from (engine side only)
    handles: np.ndarray  # [n] int64: the request's scheduler handle, -1 where not known (engine side only)
    stop_reasons: dict[int, int | str] = field(default_factory=dict)  # row -> the stop token id that ended it
    logprobs: dict[int, _Logprobs] = field(
        default_factory=dict
    )  # row -> per new token: id -> (logprob, rank)
    errors: dict[int, str] = field(default_factory=dict)  # row -> why an ignored request could not run
    segment_ends: set[int] = field(default_factory=set)  # rows of sessions that ended a segment (S15)
    pooled: dict[int, np.ndarray] = field(default_factory=dict)  # row -> a pooling request's embedding
    prompt_logprobs: dict[int, _PromptLogprobs] = field(default_factory=dict)  # row -> per prompt token

    @classmethod
    def empty(cls) -> OutputBatch:
        return cls.from_outputs([])

    @classmethod
    def from_outputs(cls, outputs: Sequence[EngineCoreOutput]) -> OutputBatch:
        """The columns of a list of outputs (for the rare outputs built one by one)."""
        lengths = [len(o.new_token_ids) for o in outputs]
        offsets = np.zeros(len(outputs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        n = len(outputs)
        return cls(
            request_ids=[o.request_id for o in outputs],
            token_offsets=offsets,
            token_ids=np.array([t for o in outputs for t in o.new_token_ids], dtype=np.int64),
            finish_reasons=np.array([FINISH_CODES.get(o.finish_reason, 0) for o in outputs], dtype=np.uint8),
            num_cached_tokens=np.array(
                [-1 if o.num_cached_tokens is None else o.num_cached_tokens for o in outputs], dtype=np.int64
            ),
            first_token=np.zeros(n, dtype=bool),
            clients=np.zeros(n, dtype=np.int64),
            handles=np.full(n, -1, dtype=np.int64),
            stop_reasons={i: o.stop_reason for i, o in enumerate(outputs) if o.stop_reason is not None},
            logprobs={i: o.new_logprobs for i, o in enumerate(outputs) if o.new_logprobs is not None},
            errors={i: o.error for i, o in enumerate(outputs) if o.error is not None},
            segment_ends={i for i, o in enumerate(outputs) if o.segment_ended},
            pooled={i: o.pooled for i, o in enumerate(outputs) if o.pooled is not None},
            prompt_logprobs={
                i: o.prompt_logprobs for i, o in enumerate(outputs) if o.prompt_logprobs is not None
            },
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self) -> Iterator[EngineCoreOutput]:
        offsets = self.token_offsets.tolist()
        tokens = self.token_ids.tolist()
        reasons = self.finish_reasons.tolist()
        cached = self.num_cached_tokens.tolist()
        for i, request_id in enumerate(self.request_ids):
            yield EngineCoreOutput(
                request_id,
                tokens[offsets[i] : offsets[i + 1]],
                FINISH_REASONS.get(reasons[i]),
                self.stop_reasons.get(i),
                self.logprobs.get(i),
                None if cached[i] < 0 else cached[i],
                self.errors.get(i),
                i in self.segment_ends,
                self.pooled.get(i),
                self.prompt_logprobs.get(i),
            )

    def select(self, rows: np.ndarray) -> OutputBatch:
        """The batch of ``rows`` (ascending row indices), e.g. one frontend's share."""
        offsets, token_ids = select_csr(self.token_offsets, self.token_ids, rows)
        new_row = {int(r): i for i, r in enumerate(rows.tolist())} if self._has_extras() else {}
        return OutputBatch(
            request_ids=np.asarray(self.request_ids, dtype=object)[rows].tolist(),
            token_offsets=offsets,
            token_ids=token_ids,
            finish_reasons=self.finish_reasons[rows],
            num_cached_tokens=self.num_cached_tokens[rows],
            first_token=self.first_token[rows],
            clients=self.clients[rows],
            handles=self.handles[rows],
            stop_reasons={new_row[r]: v for r, v in self.stop_reasons.items() if r in new_row},
            logprobs={new_row[r]: v for r, v in self.logprobs.items() if r in new_row},
            errors={new_row[r]: v for r, v in self.errors.items() if r in new_row},
            segment_ends={new_row[r] for r in self.segment_ends if r in new_row},
            pooled={new_row[r]: v for r, v in self.pooled.items() if r in new_row},
            prompt_logprobs={new_row[r]: v for r, v in self.prompt_logprobs.items() if r in new_row},
        )

    def _has_extras(self) -> bool:
        return bool(
            self.stop_reasons
            or self.logprobs
            or self.errors
            or self.segment_ends
            or self.pooled
            or self.prompt_logprobs
        )


def select_csr(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` of the CSR ``(offsets, values)``, as a new CSR."""
    starts = offsets[:-1][rows].astype(np.int64)
    lengths = offsets[1:][rows] - starts
    new_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    within = np.arange(int(new_offsets[-1])) - np.repeat(new_offsets[:-1], lengths)
    return new_offsets, values[np.repeat(starts, lengths) + within]
