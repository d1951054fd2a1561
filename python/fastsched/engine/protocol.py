"""The messages between the processes of a server (docs/design.md §1), each declared once.

Every message is a :class:`msgspec.Struct` below, and its declaration is its wire format:
a msgpack array ``[tag, field, ...]`` with the fields in declaration order (``array_like``),
the tag naming the message. :func:`encode` and :func:`decode` follow from the declarations,
and so does validation: a field of the wrong type, a negative count, an unknown tag or a
missing field raises :class:`ProtocolError`, so that a malformed message is dropped by its
receiver instead of crashing it. No pickle crosses a socket or a pipe: a peer that can
reach one must not be able to run code in the other process.

frontend -> engine (the engine's PULL socket)
    Hello, AddRequest (an ADD, or with ``request.streaming`` a session's, S15), Abort, Query,
    Pause (S13), StreamInput, CloseStream (S15), ReloadWeights, ResetPrefixCache
engine -> frontend (a PUSH socket per frontend)
    Ready, Heartbeat, Outputs, Failed, Status, Paused, Reloaded, PrefixCacheReset
child -> launcher (the ready pipe)
    an engine: Ready or Failed; a frontend: FrontendReady or Failed

The maps inside (:class:`ModelInfo`, :class:`EngineStats`, :class:`EngineRequestStatus`,
:class:`~fastsched.sampling_params.SamplingParams`, :class:`LoRARequest`) are dataclasses,
encoded as maps of their fields and type-checked on decoding the same way.

A step's outputs travel as columns (:class:`OutputColumns`): the engine packs them from its
arrays (:class:`OutputBatch`) without a Python object per row, as little-endian bytes,
and the frontend, which works per request anyway, gets one :class:`EngineCoreOutput` per row.

The engine trusts the :class:`SamplingParams` of an ADD: the frontend built them, which ran
every rule about their values (the grammar check included); decoding checks their types only
and does not run those rules again. The Rust core asserts its own invariants on what it gets.
"""

from __future__ import annotations

import time
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_type_hints

import msgspec
import numpy as np

from fastsched._core import FINISH_REASONS
from fastsched.engine.output_batch import EngineCoreOutput, OutputBatch
from fastsched.lora.request import LoRARequest
from fastsched.sampling_params import SamplingParams

Count = Annotated[int, msgspec.Meta(ge=0)]  # a count, an index or an id the receiver looks up
PauseState = Literal["unpaused", "paused_new", "paused_all"]  # the scheduler's states (S13)
PAUSE_STATES: tuple[str, ...] = ("unpaused", "paused_new", "paused_all")
PAUSE_MODES = ("new", "all")  # what a user asks for: paused_new / paused_all
UNKNOWN = "unknown"  # a request status: the engine no longer holds it; its last output is on its way
ReloadErrorKind = Literal["conflict", "invalid"]
RELOAD_CONFLICT: ReloadErrorKind = "conflict"  # the engine is not paused with mode all
RELOAD_INVALID: ReloadErrorKind = "invalid"  # the weights cannot be loaded into the served model


class ProtocolError(ValueError):
    """Bytes that are not msgpack, or not one of the messages declared here."""


def pause_state(mode: str) -> PauseState:
    """The scheduler's state for pause ``mode`` (S13): ``"new"`` lets running requests finish and
    admits nobody, ``"all"`` schedules nothing. ``ValueError`` naming the mode for another one."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return "paused_new" if mode == "new" else "paused_all"


def pause_mode(state: str) -> str | None:
    """The mode of a pause state, None when unpaused."""
    return None if state == "unpaused" else state.removeprefix("paused_")


# ------------------------------------------------------------------ the maps inside messages


class ModelInfo(msgspec.Struct, forbid_unknown_fields=True):
    """What a frontend needs to know about the engine's model (sent with READY)."""

    model: str | None  # the path the engine loaded; None = the embedded default model
    model_name: str
    max_model_len: Count
    vocab_size: Count
    block_size: Count = 16
    num_gpu_blocks: Count = 0
    max_num_seqs: Count = 0
    max_num_batched_tokens: Count = 0  # sets the TTFT-SLO valve's floor (admission.TTFT_SLO_FLOOR_STEPS)
    tokenizer: str | None = None  # --tokenizer when given; else the model's own
    # The model's sampling defaults (SamplingParams fields) for requests that leave them out.
    sampling_defaults: dict[str, float] = msgspec.field(default_factory=dict)
    # The KV cache's configuration as text (block_size, num_gpu_blocks, enable_prefix_caching, ...):
    # the labels of the metric cache_config_info, as vLLM's.
    cache_config: dict[str, str] = msgspec.field(default_factory=dict)
    # LoRA (--enable-lora): the adapters to serve from the start (--lora-modules, name -> path)
    # and the largest rank accepted; None: the engine serves no adapters.
    lora_modules: dict[str, str] | None = None
    max_lora_rank: Count = 0

    def __post_init__(self) -> None:
        unknown = set(self.sampling_defaults) - _PARAM_FIELDS
        if unknown:
            raise ValueError(f"model_info.sampling_defaults has unknown fields {sorted(unknown)}")


# Upper bounds of EngineStats.iteration_tokens' buckets: vLLM's for vllm:iteration_tokens_total.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineStats(msgspec.Struct, forbid_unknown_fields=True):
    """One engine's counters and gauges at the moment it sent them (docs/design.md §7)."""

    num_running: Count = 0
    num_waiting: Count = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: Count = 0
    prefix_cache_queries: Count = 0
    prefix_cache_hits: Count = 0
    prompt_tokens_total: Count = 0
    generation_tokens_total: Count = 0
    # Gate telemetry: why the scheduler's scans stopped / requests were skipped.
    scan_stops_total: dict[str, Count] = msgspec.field(default_factory=dict)
    skips_total: dict[str, Count] = msgspec.field(default_factory=dict)
    last_scan_stop: str | None = None
    # Prompt tokens prefilled per second while requests wait (engine.prefill_meter); None
    # until measured. The TTFT-SLO valve (--ttft-slo) sizes the prefill backlog with it.
    prefill_tokens_per_s: float | None = None
    # Step time = base + per_token x scheduled tokens (engine.step_time_meter), seconds; None
    # until fitted. The goodput valve (--tpot-slo) predicts TTFT and TPOT with it.
    step_time_base_s: float | None = None
    step_time_per_token_s: float | None = None
    # Tokens scheduled per engine step, since start: counts per bucket of ITERATION_TOKENS_BUCKETS
    # (not cumulative; the last one past the largest bound), and their sum. Empty: not counted.
    iteration_tokens: list[Count] = msgspec.field(default_factory=list)
    iteration_tokens_sum: Count = 0
    # Speculative decoding since start (vllm:spec_decode_*, fastsched.spec_decode.metrics): verified
    # proposals, their tokens, the accepted ones and those by position (k entries; empty: not speculating).
    spec_decode_num_drafts: Count = 0
    spec_decode_num_draft_tokens: Count = 0
    spec_decode_num_accepted_tokens: Count = 0
    spec_decode_num_accepted_tokens_per_pos: list[Count] = msgspec.field(default_factory=list)
    # The engine process's resource use (fastsched.process_stats), sent with heartbeats only.
    process: dict[str, float] | None = None
    # LoRA (vLLM's lora_requests_info): the adapters (names) of running and of waiting
    # requests, and max_loras; 0: the engine serves no adapters.
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    max_lora: Count = 0
    # KV connector counters (engine.kv_connector.KVConnectorStats); empty without a connector.
    kv_connector: dict[str, float] = msgspec.field(default_factory=dict)
    pause_state: PauseState = "unpaused"  # S13
    num_waiting_for_streaming_input: Count = 0  # sessions holding their slot and KV between segments (S15)

    def __post_init__(self) -> None:
        if len(self.iteration_tokens) not in (0, len(ITERATION_TOKENS_BUCKETS) + 1):
            raise ValueError(
                f"stats.iteration_tokens must have {len(ITERATION_TOKENS_BUCKETS) + 1} buckets, "
                f"got {len(self.iteration_tokens)}"
            )


class EngineRequestStatus(msgspec.Struct, forbid_unknown_fields=True):
    """Where one engine request is, as the scheduler sees it (``Scheduler.request_info``).
    The counts are zero and the optional fields None when ``status`` is ``"unknown"``."""

    request_id: str
    status: str  # the scheduler's status (waiting, running, preempted, ...) or "unknown"
    num_tokens: Count = 0
    num_prompt_tokens: Count = 0
    num_output_tokens: Count = 0
    num_computed_tokens: Count = 0
    num_cached_tokens: Count | None = None  # None before its first admission
    num_preemptions: Count = 0
    priority: int = 0
    num_blocks: Count = 0  # KV blocks it holds
    queue_position: Count | None = None  # 0-based, in admission order; None unless waiting
    num_waiting: Count | None = None  # the waiting queue's length; None unless waiting
    blocked_by: str | None = None  # the gate that stopped the last scan; None unless waiting


class RequestTiming(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Engine-side latencies of one request, in seconds since its arrival_time; the engine
    sends one with a request's first token and one when it finishes."""

    request_id: str
    queue_time: float | None  # first scheduled - arrival (docs/design.md §7: first scheduling only)
    ttft: float | None  # first token sampled - arrival
    e2e: float | None  # finished - arrival; None until it finishes


# ------------------------------------------------------------------ requests

_PARAM_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def _params_struct() -> type[msgspec.Struct]:
    """The wire type of :class:`SamplingParams`, made from its fields (declared there once):
    their types, with ``stop`` and ``stop_token_ids`` as the lists ``__post_init__`` leaves."""
    hints = get_type_hints(SamplingParams)
    hints.update(stop=list[str], stop_token_ids=list[int])
    specs = []
    for f in fields(SamplingParams):
        default: Any = f.default_factory() if f.default_factory is not MISSING else f.default
        specs.append((f.name, hints[f.name], default))
    return msgspec.defstruct("SamplingParamsWire", specs, forbid_unknown_fields=True)


_SamplingParamsWire = _params_struct()
# EngineCoreRequest.params is a SamplingParams for its users (the annotation type checkers
# read) and this struct for msgspec, which decodes it without running SamplingParams' rules.
if TYPE_CHECKING:
    _Params = SamplingParams
else:
    _Params = _SamplingParamsWire


def _trusted_params(wire: Any) -> SamplingParams:
    """The SamplingParams a frontend validated, rebuilt without validating them again."""
    params = object.__new__(SamplingParams)
    params.__dict__.update(msgspec.structs.asdict(wire))
    return params


class EngineCoreRequest(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A tokenized request as the engine receives it (in an ADD)."""

    request_id: str
    prompt_token_ids: list[int]
    params: _Params
    arrival_time: float = msgspec.field(default_factory=time.time)
    priority: int = 0
    # Report the request once, when it finishes, with all its tokens: for an in-process
    # caller that neither streams nor looks at text before the end (``fastsched.LLM``
    # without stop strings or logprobs), which then costs the engine nothing per step.
    # A frontend always asks for deltas.
    final_only: bool = False
    lora_request: LoRARequest | None = None  # the adapter to apply, None: the base model
    cache_salt: str | None = None  # vLLM's: requests with different salts never share prefix-cache blocks
    # A streaming-input session (S15): after each segment it waits for STREAM_INPUT or CLOSE_STREAM
    # instead of finishing.
    streaming: bool = False
    # A pooling request (embeddings): the step that completes its prompt reports the last prompt
    # token's hidden state, L2-normalised (EngineCoreOutput.pooled); it is prefill-only
    # (max_tokens 0, S20): no token is sampled, and that step's update finishes it.
    pooling: bool = False

    def __post_init__(self) -> None:
        if type(self.params) is _SamplingParamsWire:  # decoded
            self.params = _trusted_params(self.params)


# ------------------------------------------------------------------ a step's outputs as columns


class OutputExtra(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What one row of an :class:`OutputColumns` says beyond the columns."""

    row: Count
    stop_reason: int | str | None  # the stop token id that ended it
    logprobs: list[list[tuple[int, float, int]]] | None  # per new token: [token_id, logprob, rank], ...
    error: str | None  # why an ignored request could not run
    pooled: bytes | None = None  # a pooling request's embedding, little-endian float32
    # Per prompt token as logprobs' entries, None for the first (prompt_logprobs).
    prompt_logprobs: list[list[tuple[int, float, int]] | None] | None = None


class OutputColumns(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """An :class:`OutputBatch` on the wire: ``token_offsets`` (``n + 1`` entries, CSR into
    ``token_ids``) and ``token_ids`` little-endian uint32, ``finish_reasons`` one byte per row
    (0: still running, else a key of ``FINISH_REASONS``), ``num_cached_tokens`` little-endian
    int64 per row (-1: nothing to report); the few rows with more to say in ``extras``, and
    ``segment_ends`` the rows of streaming sessions that ended a segment and wait for input (S15)."""

    request_ids: list[str]
    token_offsets: bytes
    token_ids: bytes
    finish_reasons: bytes
    num_cached_tokens: bytes
    extras: list[OutputExtra]
    segment_ends: list[Count]

    @classmethod
    def of(cls, b: OutputBatch) -> OutputColumns:
        extras = []
        for row in sorted({*b.stop_reasons, *b.logprobs, *b.errors, *b.pooled, *b.prompt_logprobs}):
            entries = b.logprobs.get(row)
            logprobs = (
                None if entries is None else [[(t, lp, rank) for t, (lp, rank) in e.items()] for e in entries]
            )
            pooled = b.pooled.get(row)
            pooled_wire = None if pooled is None else pooled.astype("<f4").tobytes()
            prompt = b.prompt_logprobs.get(row)
            prompt_wire = (
                None
                if prompt is None
                else [None if e is None else [(t, lp, rank) for t, (lp, rank) in e.items()] for e in prompt]
            )
            extras.append(
                OutputExtra(
                    row, b.stop_reasons.get(row), logprobs, b.errors.get(row), pooled_wire, prompt_wire
                )
            )
        return cls(
            b.request_ids,
            b.token_offsets.astype("<u4").tobytes(),
            b.token_ids.astype("<u4").tobytes(),
            b.finish_reasons.astype(np.uint8).tobytes(),
            b.num_cached_tokens.astype("<i8").tobytes(),
            extras,
            sorted(b.segment_ends),
        )

    def expand(self) -> list[EngineCoreOutput]:
        """One output per row; ``ValueError`` for columns that do not fit together."""
        ids = self.request_ids
        n = len(ids)
        offsets = _column(self.token_offsets, "<u4", n + 1, "token_offsets")
        tokens = _column(self.token_ids, "<u4", None, "token_ids")
        reasons = _column(self.finish_reasons, "u1", n, "finish_reasons").tolist()
        cached = _column(self.num_cached_tokens, "<i8", n, "num_cached_tokens").tolist()
        if not (
            offsets[0] == 0
            and bool((np.diff(offsets.astype(np.int64)) >= 0).all())
            and offsets[-1] == len(tokens)
        ):
            raise ValueError("token_offsets must start at 0, never decrease and end at len(token_ids)")
        if not all(r == 0 or r in FINISH_REASONS for r in reasons):
            raise ValueError("unknown finish_reason code")
        if not all(c >= -1 for c in cached):
            raise ValueError("num_cached_tokens must be -1 or non-negative")
        token_list, bounds = tokens.tolist(), offsets.tolist()
        outputs = [
            EngineCoreOutput(
                ids[i],
                token_list[bounds[i] : bounds[i + 1]],
                FINISH_REASONS.get(reasons[i]),
                num_cached_tokens=None if cached[i] < 0 else cached[i],
            )
            for i in range(n)
        ]
        for extra in self.extras:
            if extra.row >= n:
                raise ValueError(f"extra row {extra.row} is out of range")
            out = outputs[extra.row]
            out.stop_reason, out.error = extra.stop_reason, extra.error
            if extra.logprobs is not None:
                out.new_logprobs = [{t: (lp, rank) for t, lp, rank in entry} for entry in extra.logprobs]
            if extra.pooled is not None:
                out.pooled = _column(extra.pooled, "<f4", None, "pooled")
            if extra.prompt_logprobs is not None:
                out.prompt_logprobs = [
                    None if entry is None else {t: (lp, rank) for t, lp, rank in entry}
                    for entry in extra.prompt_logprobs
                ]
        for row in self.segment_ends:
            if row >= n:
                raise ValueError(f"segment_ends row {row} is out of range")
            outputs[row].segment_ended = True
        return outputs


def _column(data: bytes, dtype: str, length: int | None, what: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise ValueError(f"{what} must be a whole number of {size}-byte values")
    column = np.frombuffer(data, dtype=dtype)
    if length is not None and len(column) != length:
        raise ValueError(f"{what} must have {length} values, got {len(column)}")
    return column


# ------------------------------------------------------------------ the messages


class _Message(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag_field="tag"):
    """A message: encoded as ``[tag, field, ...]``, tagged with its class's ``tag``."""


class Hello(_Message, tag="hello"):
    """Ask for READY (a late or restarted frontend)."""

    frontend_index: Count


class AddRequest(_Message, tag="add"):
    """Queue a request; its outputs go to frontend ``frontend_index``."""

    request: EngineCoreRequest
    frontend_index: Count


class Abort(_Message, tag="abort"):
    request_ids: list[str]


class Query(_Message, tag="query"):
    """Where are these requests? (a STATUS answers)"""

    query_id: Count
    request_ids: list[str]
    frontend_index: Count


class Pause(_Message, tag="pause"):
    """Set the pause state (S13; a PAUSED answers)."""

    state: PauseState
    query_id: Count
    frontend_index: Count


class StreamInput(_Message, tag="stream_input"):
    """A session's next segment (S15): ``token_ids``, then up to ``max_tokens`` generated."""

    request_id: str
    token_ids: list[int]
    max_tokens: Count
    is_last: bool = False


class CloseStream(_Message, tag="close_stream"):
    """End a session once its input is served (S15)."""

    request_id: str


class ReloadWeights(_Message, tag="reload_weights"):
    """Load new weights (paused_all only; a RELOADED answers)."""

    model: str  # a checkpoint of the served architecture (directory or GGUF file)
    query_id: Count
    frontend_index: Count


class ResetPrefixCache(_Message, tag="reset_prefix_cache"):
    """Drop the prefix cache (a PREFIX_CACHE_RESET answers)."""

    query_id: Count
    frontend_index: Count


class Ready(_Message, tag="ready"):
    engine_index: Count
    model_info: ModelInfo


class Heartbeat(_Message, tag="heartbeat"):
    engine_index: Count
    stats: EngineStats


class KvEvents(_Message, tag="kv_events"):
    """Block hashes that entered (``stored``) and left (``removed``) an engine's prefix cache
    since its last KV_EVENTS, each a little-endian uint64 column; sent to every frontend when
    they route by prefix (``--routing prefix``), whose summaries follow them."""

    engine_index: Count
    stored: bytes
    removed: bytes

    def hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """``(stored, removed)`` as uint64 arrays; ``ValueError`` for a column of odd length."""
        return _column(self.stored, "<u8", None, "stored"), _column(self.removed, "<u8", None, "removed")


# What Outputs.outputs is for its users (the annotation type checkers read), and on the wire.
if TYPE_CHECKING:
    _OutputsField = Union[list[EngineCoreOutput], OutputBatch]
else:
    _OutputsField = OutputColumns


class Outputs(_Message, tag="outputs"):
    """A step's outputs for one frontend. The engine gives an :class:`OutputBatch` (or a list
    of outputs), which :func:`encode` packs as :class:`OutputColumns`; :func:`decode` always
    gives the list of :class:`EngineCoreOutput`."""

    engine_index: Count
    outputs: _OutputsField
    stats: EngineStats
    timings: list[RequestTiming] = msgspec.field(default_factory=list)


class Failed(_Message, tag="failed"):
    """The sender (an engine; to the launcher, a frontend too) is about to exit on an error."""

    engine_index: Count
    message: str


class Status(_Message, tag="status"):
    """The answer to a QUERY, one status per id."""

    engine_index: Count
    query_id: Count
    statuses: list[EngineRequestStatus]


class Paused(_Message, tag="paused"):
    """The answer to a PAUSE: the state now in force."""

    engine_index: Count
    query_id: Count
    state: PauseState


class Reloaded(_Message, tag="reloaded"):
    """The answer to a RELOAD_WEIGHTS: no error, or (RELOAD_CONFLICT | RELOAD_INVALID, message)."""

    engine_index: Count
    query_id: Count
    error: tuple[ReloadErrorKind, str] | None = None


class PrefixCacheReset(_Message, tag="prefix_cache_reset"):
    """The answer to a RESET_PREFIX_CACHE, once done."""

    engine_index: Count
    query_id: Count


class FrontendReady(_Message, tag="frontend_ready"):
    """A frontend process to the launcher: it serves gRPC at ``address``."""

    frontend_index: Count
    address: str


Message = Union[
    Hello,
    AddRequest,
    Abort,
    Query,
    Pause,
    StreamInput,
    CloseStream,
    ReloadWeights,
    ResetPrefixCache,
    Ready,
    Heartbeat,
    KvEvents,
    Outputs,
    Failed,
    Status,
    Paused,
    Reloaded,
    PrefixCacheReset,
    FrontendReady,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    if type(msg) is Outputs:
        outputs = msg.outputs
        batch = outputs if isinstance(outputs, OutputBatch) else OutputBatch.from_outputs(outputs)
        msg = Outputs(msg.engine_index, OutputColumns.of(batch), msg.stats, msg.timings)  # type: ignore[arg-type]
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """The message in ``data``; :class:`ProtocolError` saying what is wrong otherwise."""
    try:
        msg = _decoder.decode(data)
        if type(msg) is Outputs:
            msg.outputs = msg.outputs.expand()  # type: ignore[union-attr]
    except (msgspec.DecodeError, ValueError, TypeError) as e:  # ValidationError is a DecodeError
        raise ProtocolError(f"invalid message: {e}") from e
    return msg
