"""The messages between frontends and engine processes (docs/design.md §1), as msgpack.

No pickle crosses a socket: a peer that can reach the socket must not be able to
run code in the other process, and msgpack keeps each message a few bytes of plain
data. Every message is a msgpack array whose first element is its tag:

frontend -> engine (the engine's PULL socket at its input address)
    ["hello",   frontend_index]                       ask for READY (a late or restarted frontend)
    ["add",     request_id, prompt_token_ids, params, arrival_time, priority, frontend_index, lora, cache_salt]
    ["abort",   [request_id, ...]]
    ["query",   query_id, [request_id, ...], frontend_index]   where are these requests? (a STATUS answers)
    ["pause",   state, query_id, frontend_index]       set the pause state (S13; a PAUSED answers)
    ["session", request_id, prompt_token_ids, params, arrival_time, priority, frontend_index, lora, cache_salt]
                                                       an ADD that opens a streaming-input session (S15)
    ["stream_input", request_id, token_ids, max_tokens, is_last]   a session's next segment
    ["close_stream", request_id]                       end a session once its input is served
    ["reload_weights", model, query_id, frontend_index]   load new weights (paused_all only; a RELOADED answers)
    ["reset_prefix_cache", query_id, frontend_index]   drop the prefix cache (a PREFIX_CACHE_RESET answers)

engine -> frontend (a PUSH socket per frontend, connected to its output address)
    ["ready",     engine_index, model_info]
    ["heartbeat", engine_index, stats]
    ["outputs",   engine_index, columns, stats, [timing, ...]]
    ["failed",    engine_index, message]               the engine is about to exit on an error
    ["status",    engine_index, query_id, [status, ...]]   the answer to a QUERY, one status per id
    ["paused",    engine_index, query_id, state]       the answer to a PAUSE: the state now in force
    ["reloaded",  engine_index, query_id, error]       the answer to a RELOAD_WEIGHTS: nil, or [kind, message]
    ["prefix_cache_reset", engine_index, query_id]     the answer to a RESET_PREFIX_CACHE, once done

``params`` is a map of :class:`SamplingParams` fields, ``lora`` ``nil`` or the request's
adapter as ``[name, id, path]`` (:class:`LoRARequest`), ``cache_salt`` ``nil`` or a string;
``model_info`` and ``stats``
are maps (:class:`ModelInfo`, :class:`EngineStats`). A step's outputs travel as
``columns`` (:class:`OutputBatch`), one row per request that progressed or ended:
``[request_ids, token_offsets, token_ids, finish_reasons, num_cached_tokens, extras, segment_ends]``,
where ``token_offsets`` (``n + 1`` entries, CSR into ``token_ids``) and ``token_ids``
are little-endian uint32 bytes, ``finish_reasons`` one byte per row (0 = still
running, else a key of ``FINISH_REASONS``), ``num_cached_tokens`` little-endian int64
per row (-1: nothing to report), and ``extras`` the few rows with more to say:
``[row, stop_reason, logprobs, error]``, ``logprobs`` ``nil`` or, per new token, a list
of ``[token_id, logprob, rank]``, and ``segment_ends`` the rows of streaming sessions that
ended a segment and now wait for input (S15). Columns because an engine step reports up to
thousands of rows: the engine packs them from its arrays without a Python object per
row, and the frontend, which works per request anyway, expands them into one
:class:`EngineCoreOutput` per row. A ``timing`` is ``[request_id, queue_time, ttft, e2e]``
in seconds since the request's ``arrival_time`` (``nil`` where not known yet); the
engine sends one with a request's first token and one when it finishes. A ``status``
is a map of :class:`EngineRequestStatus` fields, read from the scheduler between steps
(``engine.status``); an id the engine no longer holds has status ``"unknown"``.

``decode`` validates shape and types and raises :class:`ProtocolError` on anything
else, so a malformed message is dropped by the receiver instead of crashing it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Union

import msgpack
import numpy as np

from fastsched._core import FINISH_REASONS
from fastsched.lora.request import LoRARequest
from fastsched.sampling_params import SamplingParams

FINISH_CODES = {reason: code for code, reason in FINISH_REASONS.items()}



@dataclass
class EngineCoreRequest:
    """A tokenized request as the engine receives it (the ADD message)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    # Report the request once, when it finishes, with all its tokens: for an in-process
    # caller that neither streams nor looks at text before the end (``fastsched.LLM``
    # without stop strings or logprobs), which then costs the engine nothing per step.
    # Not on the wire: a frontend always gets deltas.
    final_only: bool = False
    lora_request: LoRARequest | None = None  # the adapter to apply, None: the base model
    # vLLM's cache_salt: requests with different salts never share prefix-cache blocks.
    cache_salt: str | None = None
    # A streaming-input session (S15): after each segment it waits for STREAM_INPUT or CLOSE_STREAM
    # instead of finishing. Sent as a SESSION message rather than an ADD.
    streaming: bool = False


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


_Logprobs = list[dict[int, tuple[float, int]]]


@dataclass(eq=False)
class OutputBatch:
    """One engine step's outputs as columns: row ``i`` is one request's delta.

    The engine fills it from the scheduler's arrays without a Python object per row;
    rows that need more than the columns (a stop token id, logprobs, an error) are the
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
    stop_reasons: dict[int, int | str] = field(default_factory=dict)  # row -> the stop token id that ended it
    logprobs: dict[int, _Logprobs] = field(default_factory=dict)  # row -> per new token: id -> (logprob, rank)
    errors: dict[int, str] = field(default_factory=dict)  # row -> why an ignored request could not run
    segment_ends: set[int] = field(default_factory=set)  # rows of sessions that ended a segment (S15)

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
            num_cached_tokens=np.array([-1 if o.num_cached_tokens is None else o.num_cached_tokens
                                        for o in outputs], dtype=np.int64),
            first_token=np.zeros(n, dtype=bool),
            clients=np.zeros(n, dtype=np.int64),
            stop_reasons={i: o.stop_reason for i, o in enumerate(outputs) if o.stop_reason is not None},
            logprobs={i: o.new_logprobs for i, o in enumerate(outputs) if o.new_logprobs is not None},
            errors={i: o.error for i, o in enumerate(outputs) if o.error is not None},
            segment_ends={i for i, o in enumerate(outputs) if o.segment_ended},
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
            stop_reasons={new_row[r]: v for r, v in self.stop_reasons.items() if r in new_row},
            logprobs={new_row[r]: v for r, v in self.logprobs.items() if r in new_row},
            errors={new_row[r]: v for r, v in self.errors.items() if r in new_row},
            segment_ends={new_row[r] for r in self.segment_ends if r in new_row},
        )

    def _has_extras(self) -> bool:
        return bool(self.stop_reasons or self.logprobs or self.errors or self.segment_ends)


def select_csr(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` of the CSR ``(offsets, values)``, as a new CSR."""
    starts = offsets[:-1][rows].astype(np.int64)
    lengths = offsets[1:][rows] - starts
    new_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    within = np.arange(int(new_offsets[-1])) - np.repeat(new_offsets[:-1], lengths)
    return new_offsets, values[np.repeat(starts, lengths) + within]


UNKNOWN = "unknown"  # a request status: the engine no longer holds it; its last output is on its way

HELLO = "hello"
ADD = "add"
ABORT = "abort"
READY = "ready"
HEARTBEAT = "heartbeat"
OUTPUTS = "outputs"
FAILED = "failed"
QUERY = "query"
STATUS = "status"
PAUSE = "pause"
PAUSED = "paused"
SESSION = "session"
STREAM_INPUT = "stream_input"
CLOSE_STREAM = "close_stream"
RELOAD_WEIGHTS = "reload_weights"
RELOADED = "reloaded"
RELOAD_CONFLICT = "conflict"  # a RELOADED error kind: the engine is not paused with mode all
RELOAD_INVALID = "invalid"  # a RELOADED error kind: the weights cannot be loaded into the served model
RESET_PREFIX_CACHE = "reset_prefix_cache"
PREFIX_CACHE_RESET = "prefix_cache_reset"

PAUSE_STATES = ("unpaused", "paused_new", "paused_all")  # the scheduler's states (S13)
PAUSE_MODES = ("new", "all")  # what a user asks for: paused_new / paused_all


def pause_state(mode: str) -> str:
    """The scheduler's state for pause ``mode`` (S13): ``"new"`` lets running requests finish and
    admits nobody, ``"all"`` schedules nothing. ``ValueError`` naming the mode for another one."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return f"paused_{mode}"


def pause_mode(state: str) -> str | None:
    """The mode of a pause state, None when unpaused."""
    return None if state == "unpaused" else state.removeprefix("paused_")

_PARAM_FIELDS = frozenset(f.name for f in fields(SamplingParams))


class ProtocolError(ValueError):
    """A message that is not valid msgpack or not one of the shapes above."""


@dataclass
class ModelInfo:
    """What a frontend needs to know about the engine's model (sent with READY)."""

    model: str | None  # the path the engine loaded; None = the embedded default model
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int = 16
    num_gpu_blocks: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0  # sets the TTFT-SLO valve's floor (admission.TTFT_SLO_FLOOR_STEPS)
    tokenizer: str | None = None  # --tokenizer when given; else the model's own
    # The model's sampling defaults (SamplingParams fields) for requests that leave them out.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # The KV cache's configuration as text (block_size, num_gpu_blocks, enable_prefix_caching, ...):
    # the labels of the metric cache_config_info, as vLLM's.
    cache_config: dict[str, str] = field(default_factory=dict)
    # LoRA (--enable-lora): the adapters to serve from the start (--lora-modules, name -> path)
    # and the largest rank accepted; None: the engine serves no adapters.
    lora_modules: dict[str, str] | None = None
    max_lora_rank: int = 0


# Upper bounds of EngineStats.iteration_tokens' buckets: vLLM's for vllm:iteration_tokens_total.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineStats:
    """One engine's counters and gauges at the moment it sent them (docs/design.md §7)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # Gate telemetry: why the scheduler's scans stopped / requests were skipped.
    scan_stops_total: dict[str, int] = field(default_factory=dict)
    skips_total: dict[str, int] = field(default_factory=dict)
    last_scan_stop: str | None = None
    # Prompt tokens prefilled per second while requests wait (engine.prefill_meter); None
    # until measured. The TTFT-SLO valve (--ttft-slo) sizes the prefill backlog with it.
    prefill_tokens_per_s: float | None = None
    # Tokens scheduled per engine step, since start: counts per bucket of ITERATION_TOKENS_BUCKETS
    # (not cumulative; the last one past the largest bound), and their sum. Empty: not counted.
    iteration_tokens: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
    # Speculative decoding since start (vllm:spec_decode_*, fastsched.spec_decode.metrics): verified
    # proposals, their tokens, the accepted ones and those by position (k entries; empty: not speculating).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # The engine process's resource use (fastsched.process_stats), sent with heartbeats only.
    process: dict[str, float] | None = None
    # LoRA (vLLM's lora_requests_info): the adapters (names) of running and of waiting
    # requests, and max_loras; 0: the engine serves no adapters.
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0
    # KV connector counters (engine.kv_connector.KVConnectorStats); empty without a connector.
    kv_connector: dict[str, float] = field(default_factory=dict)
    pause_state: str = "unpaused"  # one of PAUSE_STATES (S13)
    num_waiting_for_streaming_input: int = 0  # sessions holding their slot and KV between segments (S15)


@dataclass
class RequestTiming:
    """Engine-side latencies of one request, in seconds since its arrival_time."""

    request_id: str
    queue_time: float | None  # first scheduled - arrival (docs/design.md §7: first scheduling only)
    ttft: float | None  # first token sampled - arrival
    e2e: float | None  # finished - arrival; None until it finishes


@dataclass
class Hello:
    frontend_index: int


@dataclass
class AddRequest:
    request: EngineCoreRequest
    frontend_index: int


@dataclass
class Abort:
    request_ids: list[str]


@dataclass
class Ready:
    engine_index: int
    model_info: ModelInfo


@dataclass
class Heartbeat:
    engine_index: int
    stats: EngineStats


@dataclass
class Outputs:
    engine_index: int
    # The engine sends an OutputBatch; decode() always gives the list.
    outputs: list[EngineCoreOutput] | OutputBatch
    stats: EngineStats
    timings: list[RequestTiming] = field(default_factory=list)


@dataclass
class Failed:
    engine_index: int
    message: str


@dataclass
class EngineRequestStatus:
    """Where one engine request is, as the scheduler sees it (``Scheduler.request_info``).
    The counts are zero and the optional fields None when ``status`` is ``"unknown"``."""

    request_id: str
    status: str  # the scheduler's status (waiting, running, preempted, ...) or "unknown"
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # None before its first admission
    num_preemptions: int = 0
    priority: int = 0
    num_blocks: int = 0  # KV blocks it holds
    queue_position: int | None = None  # 0-based, in admission order; None unless waiting
    num_waiting: int | None = None  # the waiting queue's length; None unless waiting
    blocked_by: str | None = None  # the gate that stopped the last scan; None unless waiting


@dataclass
class Query:
    query_id: int
    request_ids: list[str]
    frontend_index: int


@dataclass
class Status:
    engine_index: int
    query_id: int
    statuses: list[EngineRequestStatus]


@dataclass
class Pause:
    state: str  # one of PAUSE_STATES
    query_id: int
    frontend_index: int


@dataclass
class Paused:
    engine_index: int
    query_id: int
    state: str


@dataclass
class StreamInput:
    request_id: str
    token_ids: list[int]
    max_tokens: int
    is_last: bool = False


@dataclass
class CloseStream:
    request_id: str


@dataclass
class ReloadWeights:
    model: str  # a checkpoint of the served architecture (directory or GGUF file)
    query_id: int
    frontend_index: int


@dataclass
class Reloaded:
    engine_index: int
    query_id: int
    error: tuple[str, str] | None = None  # (RELOAD_CONFLICT or RELOAD_INVALID, message)


@dataclass
class ResetPrefixCache:
    query_id: int
    frontend_index: int


@dataclass
class PrefixCacheReset:
    engine_index: int
    query_id: int


Message = Union[Hello, AddRequest, Abort, Ready, Heartbeat, Outputs, Failed, Query, Status, Pause, Paused,
                StreamInput, CloseStream, ReloadWeights, Reloaded, ResetPrefixCache, PrefixCacheReset]


# ------------------------------------------------------------------ encode


def encode(msg: Message) -> bytes:
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def _to_wire(msg: Message) -> list[Any]:
    if isinstance(msg, Hello):
        return [HELLO, msg.frontend_index]
    if isinstance(msg, AddRequest):
        r = msg.request
        return [SESSION if r.streaming else ADD, r.request_id, list(r.prompt_token_ids), dataclasses.asdict(r.params),
                float(r.arrival_time), int(r.priority), msg.frontend_index, _lora_to_wire(r.lora_request),
                r.cache_salt]
    if isinstance(msg, Abort):
        return [ABORT, list(msg.request_ids)]
    if isinstance(msg, Ready):
        return [READY, msg.engine_index, dataclasses.asdict(msg.model_info)]
    if isinstance(msg, Heartbeat):
        return [HEARTBEAT, msg.engine_index, _stats_to_wire(msg.stats)]
    if isinstance(msg, Outputs):
        batch = msg.outputs if isinstance(msg.outputs, OutputBatch) else OutputBatch.from_outputs(msg.outputs)
        return [OUTPUTS, msg.engine_index, _batch_to_wire(batch), _stats_to_wire(msg.stats),
                [[t.request_id, t.queue_time, t.ttft, t.e2e] for t in msg.timings]]
    if isinstance(msg, Failed):
        return [FAILED, msg.engine_index, msg.message]
    if isinstance(msg, Query):
        return [QUERY, msg.query_id, list(msg.request_ids), msg.frontend_index]
    if isinstance(msg, Status):
        return [STATUS, msg.engine_index, msg.query_id, [dataclasses.asdict(s) for s in msg.statuses]]
    if isinstance(msg, Pause):
        return [PAUSE, msg.state, msg.query_id, msg.frontend_index]
    if isinstance(msg, Paused):
        return [PAUSED, msg.engine_index, msg.query_id, msg.state]
    if isinstance(msg, StreamInput):
        return [STREAM_INPUT, msg.request_id, list(msg.token_ids), msg.max_tokens, msg.is_last]
    if isinstance(msg, CloseStream):
        return [CLOSE_STREAM, msg.request_id]
    if isinstance(msg, ReloadWeights):
        return [RELOAD_WEIGHTS, msg.model, msg.query_id, msg.frontend_index]
    if isinstance(msg, Reloaded):
        return [RELOADED, msg.engine_index, msg.query_id, None if msg.error is None else list(msg.error)]
    if isinstance(msg, ResetPrefixCache):
        return [RESET_PREFIX_CACHE, msg.query_id, msg.frontend_index]
    if isinstance(msg, PrefixCacheReset):
        return [PREFIX_CACHE_RESET, msg.engine_index, msg.query_id]
    raise TypeError(f"not a protocol message: {type(msg).__name__}")


_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))


def _stats_to_wire(stats: EngineStats) -> dict[str, Any]:
    """A shallow map: sent with every step's outputs, where ``dataclasses.asdict``'s deep
    copy of the counter maps cost more than packing them."""
    return {name: getattr(stats, name) for name in _STATS_FIELDS}


def _batch_to_wire(b: OutputBatch) -> list[Any]:
    extras = []
    for row in sorted({*b.stop_reasons, *b.logprobs, *b.errors}):
        entries = b.logprobs.get(row)
        logprobs = None if entries is None else [[[t, lp, rank] for t, (lp, rank) in e.items()] for e in entries]
        extras.append([row, b.stop_reasons.get(row), logprobs, b.errors.get(row)])
    return [
        b.request_ids,
        b.token_offsets.astype("<u4").tobytes(),
        b.token_ids.astype("<u4").tobytes(),
        b.finish_reasons.astype(np.uint8).tobytes(),
        b.num_cached_tokens.astype("<i8").tobytes(),
        extras,
        sorted(b.segment_ends),
    ]


# ------------------------------------------------------------------ decode


def decode(data: bytes) -> Message:
    try:
        wire = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"not a msgpack message: {e}") from e
    if not isinstance(wire, list) or not wire or not isinstance(wire[0], str):
        raise ProtocolError("a message must be a non-empty array starting with its tag")
    tag, body = wire[0], wire[1:]
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise ProtocolError(f"unknown message tag {tag!r}")
    arity = _ARITY[tag]
    if len(body) != arity:
        raise ProtocolError(f"{tag!r} message has {len(body)} fields, expected {arity}")
    try:
        return decoder(*body)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as e:  # e.g. SamplingParams validation
        raise ProtocolError(f"invalid {tag!r} message: {e}") from e


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError(what)


def _int(v: Any, what: str) -> int:
    _check(isinstance(v, int) and not isinstance(v, bool), f"{what} must be an int, got {type(v).__name__}")
    return v


def _index(v: Any, what: str) -> int:
    _check(_int(v, what) >= 0, f"{what} must be non-negative, got {v}")
    return v


def _float(v: Any, what: str) -> float:
    _check(isinstance(v, (int, float)) and not isinstance(v, bool), f"{what} must be a number, got {type(v).__name__}")
    return float(v)


def _opt_float(v: Any, what: str) -> float | None:
    return None if v is None else _float(v, what)


def _str(v: Any, what: str) -> str:
    _check(isinstance(v, str), f"{what} must be a string, got {type(v).__name__}")
    return v


def _int_list(v: Any, what: str) -> list[int]:
    _check(isinstance(v, list), f"{what} must be an array")
    _check(all(isinstance(t, int) and not isinstance(t, bool) for t in v), f"{what} must hold ints only")
    return v


def _map(v: Any, what: str) -> dict[str, Any]:
    _check(isinstance(v, dict), f"{what} must be a map")
    return v


def _decode_hello(frontend_index: Any) -> Hello:
    return Hello(_index(frontend_index, "frontend_index"))


def _lora_to_wire(lora: LoRARequest | None) -> list[Any] | None:
    return None if lora is None else [lora.name, lora.id, lora.path]


def _decode_lora(value: Any) -> LoRARequest | None:
    if value is None:
        return None
    _check(isinstance(value, list) and len(value) == 3, "lora must be nil or [name, id, path]")
    return LoRARequest(_str(value[0], "lora name"), _int(value[1], "lora id"), _str(value[2], "lora path"))


def _decode_add(request_id: Any, prompt: Any, params: Any, arrival: Any, priority: Any, frontend: Any,
                lora: Any, cache_salt: Any) -> AddRequest:
    params = _map(params, "params")
    unknown = set(params) - _PARAM_FIELDS
    _check(not unknown, f"unknown sampling parameters: {', '.join(sorted(map(str, unknown)))}")
    request = EngineCoreRequest(
        _str(request_id, "request_id"),
        _int_list(prompt, "prompt_token_ids"),
        SamplingParams(**params),
        _float(arrival, "arrival_time"),
        _int(priority, "priority"),
        lora_request=_decode_lora(lora),
        cache_salt=None if cache_salt is None else _str(cache_salt, "cache_salt"),
    )
    return AddRequest(request, _index(frontend, "frontend_index"))


def _decode_session(request_id: Any, prompt: Any, params: Any, arrival: Any, priority: Any,
                    frontend: Any, lora: Any, cache_salt: Any) -> AddRequest:
    msg = _decode_add(request_id, prompt, params, arrival, priority, frontend, lora, cache_salt)
    msg.request.streaming = True
    return msg


def _decode_pause(state: Any, query_id: Any, frontend: Any) -> Pause:
    _check(state in PAUSE_STATES, f"pause state must be one of {PAUSE_STATES}, got {state!r}")
    return Pause(state, _index(query_id, "query_id"), _index(frontend, "frontend_index"))


def _decode_paused(engine_index: Any, query_id: Any, state: Any) -> Paused:
    _check(state in PAUSE_STATES, f"pause state must be one of {PAUSE_STATES}, got {state!r}")
    return Paused(_index(engine_index, "engine_index"), _index(query_id, "query_id"), state)


def _decode_stream_input(request_id: Any, token_ids: Any, max_tokens: Any, is_last: Any) -> StreamInput:
    _check(isinstance(is_last, bool), "is_last must be a bool")
    return StreamInput(_str(request_id, "request_id"), _int_list(token_ids, "token_ids"),
                       _index(max_tokens, "max_tokens"), is_last)


def _decode_close_stream(request_id: Any) -> CloseStream:
    return CloseStream(_str(request_id, "request_id"))


def _decode_reload_weights(model: Any, query_id: Any, frontend: Any) -> ReloadWeights:
    return ReloadWeights(_str(model, "model"), _index(query_id, "query_id"), _index(frontend, "frontend_index"))


def _decode_reloaded(engine_index: Any, query_id: Any, error: Any) -> Reloaded:
    if error is not None:
        _check(isinstance(error, list) and len(error) == 2 and error[0] in (RELOAD_CONFLICT, RELOAD_INVALID),
               "a reload error must be [conflict|invalid, message]")
        error = (error[0], _str(error[1], "reload error message"))
    return Reloaded(_index(engine_index, "engine_index"), _index(query_id, "query_id"), error)


def _decode_reset_prefix_cache(query_id: Any, frontend: Any) -> ResetPrefixCache:
    return ResetPrefixCache(_index(query_id, "query_id"), _index(frontend, "frontend_index"))


def _decode_prefix_cache_reset(engine_index: Any, query_id: Any) -> PrefixCacheReset:
    return PrefixCacheReset(_index(engine_index, "engine_index"), _index(query_id, "query_id"))


def _decode_abort(request_ids: Any) -> Abort:
    _check(isinstance(request_ids, list), "request_ids must be an array")
    return Abort([_str(r, "request_id") for r in request_ids])


def _decode_dataclass(cls: type, value: Any, what: str) -> Any:
    value = _map(value, what)
    names = {f.name: f for f in fields(cls)}
    unknown = set(value) - set(names)
    _check(not unknown, f"unknown {what} fields: {', '.join(sorted(map(str, unknown)))}")
    return cls(**value)


def _decode_model_info(value: Any) -> ModelInfo:
    info = _decode_dataclass(ModelInfo, value, "model_info")
    _check(info.model is None or isinstance(info.model, str), "model_info.model must be a string or nil")
    _check(info.tokenizer is None or isinstance(info.tokenizer, str), "model_info.tokenizer must be a string or nil")
    _str(info.model_name, "model_info.model_name")
    for name in ("max_model_len", "vocab_size", "block_size", "num_gpu_blocks", "max_num_seqs",
                 "max_num_batched_tokens"):
        _index(getattr(info, name), f"model_info.{name}")
    for key, value in _map(info.cache_config, "model_info.cache_config").items():
        _str(value, f"model_info.cache_config[{_str(key, 'model_info.cache_config key')}]")
    for key, value in _map(info.sampling_defaults, "model_info.sampling_defaults").items():
        _check(key in _PARAM_FIELDS, f"model_info.sampling_defaults has unknown field {key!r}")
        _float(value, f"model_info.sampling_defaults[{key}]")
    return info


def _decode_stats(value: Any) -> EngineStats:
    stats = _decode_dataclass(EngineStats, value, "stats")
    for f in fields(EngineStats):
        value = getattr(stats, f.name)
        if f.name == "kv_cache_usage":
            stats.kv_cache_usage = _float(value, "stats.kv_cache_usage")
        elif f.name == "prefill_tokens_per_s":
            stats.prefill_tokens_per_s = _opt_float(value, "stats.prefill_tokens_per_s")
        elif f.name in ("scan_stops_total", "skips_total"):
            for key, count in _map(value, f"stats.{f.name}").items():
                _index(count, f"stats.{f.name}[{_str(key, f'stats.{f.name} key')}]")
        elif f.name == "pause_state":
            _check(value in PAUSE_STATES, f"stats.pause_state must be one of {PAUSE_STATES}, got {value!r}")
        elif f.name == "last_scan_stop":
            _check(value is None or isinstance(value, str), "stats.last_scan_stop must be a string or nil")
        elif f.name == "iteration_tokens":
            _int_list(value, "stats.iteration_tokens")
            _check(len(value) in (0, len(ITERATION_TOKENS_BUCKETS) + 1),
                   f"stats.iteration_tokens must have {len(ITERATION_TOKENS_BUCKETS) + 1} buckets")
            _check(all(c >= 0 for c in value), "stats.iteration_tokens must be non-negative")
        elif f.name == "spec_decode_num_accepted_tokens_per_pos":
            _int_list(value, f"stats.{f.name}")
            _check(all(c >= 0 for c in value), f"stats.{f.name} must be non-negative")
        elif f.name in ("running_lora_adapters", "waiting_lora_adapters"):
            _check(isinstance(value, list), f"stats.{f.name} must be an array")
            for name in value:
                _str(name, f"stats.{f.name} entry")
        elif f.name == "kv_connector":
            for key, number in _map(value, "stats.kv_connector").items():
                _float(number, f"stats.kv_connector[{_str(key, 'stats.kv_connector key')}]")
        elif f.name == "process":
            if value is not None:
                for key, number in _map(value, "stats.process").items():
                    _float(number, f"stats.process[{_str(key, 'stats.process key')}]")
        else:
            _index(value, f"stats.{f.name}")
    return stats


def _decode_ready(engine_index: Any, model_info: Any) -> Ready:
    return Ready(_index(engine_index, "engine_index"), _decode_model_info(model_info))


def _decode_heartbeat(engine_index: Any, stats: Any) -> Heartbeat:
    return Heartbeat(_index(engine_index, "engine_index"), _decode_stats(stats))


def _decode_logprobs(logprobs: Any) -> _Logprobs | None:
    if logprobs is None:
        return None
    _check(isinstance(logprobs, list), "logprobs must be an array")
    entries = []
    for entry in logprobs:
        _check(isinstance(entry, list), "a logprobs entry must be an array")
        row: dict[int, tuple[float, int]] = {}
        for item in entry:
            _check(isinstance(item, list) and len(item) == 3, "a logprob must be [token_id, logprob, rank]")
            row[_int(item[0], "token_id")] = (_float(item[1], "logprob"), _int(item[2], "rank"))
        entries.append(row)
    return entries


def _column(data: Any, dtype: str, length: int | None, what: str) -> np.ndarray:
    _check(isinstance(data, bytes), f"{what} must be bytes")
    size = np.dtype(dtype).itemsize
    _check(len(data) % size == 0, f"{what} must be a whole number of {size}-byte values")
    column = np.frombuffer(data, dtype=dtype)
    _check(length is None or len(column) == length, f"{what} must have {length} values, got {len(column)}")
    return column


def _decode_batch(columns: Any) -> list[EngineCoreOutput]:
    _check(isinstance(columns, list) and len(columns) == 7, "outputs must be an array of 7 columns")
    request_ids, offsets_b, tokens_b, reasons_b, cached_b, extras, segment_ends = columns
    _check(isinstance(request_ids, list), "request_ids must be an array")
    ids = [_str(r, "request_id") for r in request_ids]
    n = len(ids)
    offsets = _column(offsets_b, "<u4", n + 1, "token_offsets")
    tokens = _column(tokens_b, "<u4", None, "token_ids")
    reasons = _column(reasons_b, "u1", n, "finish_reasons").tolist()
    cached = _column(cached_b, "<i8", n, "num_cached_tokens").tolist()
    _check(offsets[0] == 0 and bool((np.diff(offsets.astype(np.int64)) >= 0).all()) and offsets[-1] == len(tokens),
           "token_offsets must start at 0, never decrease and end at len(token_ids)")
    _check(all(r == 0 or r in FINISH_REASONS for r in reasons), "unknown finish_reason code")
    _check(all(c >= -1 for c in cached), "num_cached_tokens must be -1 or non-negative")
    token_list, bounds = tokens.tolist(), offsets.tolist()
    outputs = [
        EngineCoreOutput(ids[i], token_list[bounds[i] : bounds[i + 1]], FINISH_REASONS.get(reasons[i]),
                         num_cached_tokens=None if cached[i] < 0 else cached[i])
        for i in range(n)
    ]
    _check(isinstance(extras, list), "extras must be an array")
    for extra in extras:
        _check(isinstance(extra, list) and len(extra) == 4, "an extra must be [row, stop_reason, logprobs, error]")
        row, stop_reason, logprobs, error = extra
        _check(0 <= _int(row, "extra row") < n, f"extra row {row} is out of range")
        _check(stop_reason is None or isinstance(stop_reason, (int, str)), "stop_reason must be an int, a string or nil")
        _check(error is None or isinstance(error, str), "error must be a string or nil")
        out = outputs[row]
        out.stop_reason, out.new_logprobs, out.error = stop_reason, _decode_logprobs(logprobs), error
    for row in _int_list(segment_ends, "segment_ends"):
        _check(0 <= row < n, f"segment_ends row {row} is out of range")
        outputs[row].segment_ended = True
    return outputs


def _decode_timing(t: Any) -> RequestTiming:
    _check(isinstance(t, list) and len(t) == 4, "a timing must be [request_id, queue_time, ttft, e2e]")
    return RequestTiming(
        _str(t[0], "request_id"), _opt_float(t[1], "queue_time"), _opt_float(t[2], "ttft"), _opt_float(t[3], "e2e")
    )


def _decode_outputs(engine_index: Any, outputs: Any, stats: Any, timings: Any) -> Outputs:
    _check(isinstance(timings, list), "timings must be an array")
    return Outputs(
        _index(engine_index, "engine_index"),
        _decode_batch(outputs),
        _decode_stats(stats),
        [_decode_timing(t) for t in timings],
    )


def _decode_failed(engine_index: Any, message: Any) -> Failed:
    return Failed(_index(engine_index, "engine_index"), _str(message, "message"))


def _decode_query(query_id: Any, request_ids: Any, frontend: Any) -> Query:
    _check(isinstance(request_ids, list), "request_ids must be an array")
    return Query(_index(query_id, "query_id"), [_str(r, "request_id") for r in request_ids],
                 _index(frontend, "frontend_index"))


def _decode_request_status(value: Any) -> EngineRequestStatus:
    s = _decode_dataclass(EngineRequestStatus, value, "status")
    _str(s.request_id, "status.request_id")
    _str(s.status, "status.status")
    for name in ("num_tokens", "num_prompt_tokens", "num_output_tokens", "num_computed_tokens", "num_preemptions",
                 "num_blocks"):
        _index(getattr(s, name), f"status.{name}")
    _int(s.priority, "status.priority")
    for name in ("num_cached_tokens", "queue_position", "num_waiting"):
        if getattr(s, name) is not None:
            _index(getattr(s, name), f"status.{name}")
    _check(s.blocked_by is None or isinstance(s.blocked_by, str), "status.blocked_by must be a string or nil")
    return s


def _decode_status(engine_index: Any, query_id: Any, statuses: Any) -> Status:
    _check(isinstance(statuses, list), "statuses must be an array")
    return Status(_index(engine_index, "engine_index"), _index(query_id, "query_id"),
                  [_decode_request_status(s) for s in statuses])


_DECODERS = {
    HELLO: _decode_hello,
    ADD: _decode_add,
    ABORT: _decode_abort,
    READY: _decode_ready,
    HEARTBEAT: _decode_heartbeat,
    OUTPUTS: _decode_outputs,
    FAILED: _decode_failed,
    QUERY: _decode_query,
    STATUS: _decode_status,
    PAUSE: _decode_pause,
    PAUSED: _decode_paused,
    SESSION: _decode_session,
    STREAM_INPUT: _decode_stream_input,
    CLOSE_STREAM: _decode_close_stream,
    RELOAD_WEIGHTS: _decode_reload_weights,
    RELOADED: _decode_reloaded,
    RESET_PREFIX_CACHE: _decode_reset_prefix_cache,
    PREFIX_CACHE_RESET: _decode_prefix_cache_reset,
}
_ARITY = {HELLO: 1, ADD: 8, ABORT: 1, READY: 2, HEARTBEAT: 2, OUTPUTS: 4, FAILED: 2, QUERY: 3, STATUS: 3,
          PAUSE: 3, PAUSED: 3, SESSION: 8, STREAM_INPUT: 4, CLOSE_STREAM: 1, RELOAD_WEIGHTS: 3, RELOADED: 3,
          RESET_PREFIX_CACHE: 2, PREFIX_CACHE_RESET: 2}
