"""The messages between frontends and engine processes (docs/design.md §1), as msgpack.

No pickle crosses a socket: a peer that can reach the socket must not be able to
run code in the other process, and msgpack keeps each message a few bytes of plain
data. Every message is a msgpack array whose first element is its tag:

frontend -> engine (the engine's PULL socket at its input address)
    ["hello",   frontend_index]                       ask for READY (a late or restarted frontend)
    ["add",     request_id, prompt_token_ids, params, arrival_time, priority, frontend_index]
    ["abort",   [request_id, ...]]
    ["query",   query_id, [request_id, ...], frontend_index]   where are these requests? (a STATUS answers)

engine -> frontend (a PUSH socket per frontend, connected to its output address)
    ["ready",     engine_index, model_info]
    ["heartbeat", engine_index, stats]
    ["outputs",   engine_index, [output, ...], stats, [timing, ...]]
    ["failed",    engine_index, message]               the engine is about to exit on an error
    ["status",    engine_index, query_id, [status, ...]]   the answer to a QUERY, one status per id

``params`` is a map of :class:`SamplingParams` fields; ``model_info`` and ``stats``
are maps (:class:`ModelInfo`, :class:`EngineStats`). An ``output`` is the compact list
``[request_id, new_token_ids, finish_reason, stop_reason, logprobs, num_cached_tokens,
error]`` with ``logprobs`` ``nil`` or, per new token, a list of
``[token_id, logprob, rank]``. A ``timing`` is ``[request_id, queue_time, ttft, e2e]``
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
from dataclasses import dataclass, field, fields
from typing import Any, Union

import msgpack

from fastsched._core import FINISH_REASONS
from fastsched.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """A tokenized request as the engine receives it (the ADD message)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0


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

_PARAM_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_FINISH_REASONS = frozenset(FINISH_REASONS.values())


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
    # The KV cache's configuration as text (block_size, num_gpu_blocks, enable_prefix_caching, ...):
    # the labels of the metric cache_config_info, as vLLM's.
    cache_config: dict[str, str] = field(default_factory=dict)


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
    # The engine process's resource use (fastsched.process_stats), sent with heartbeats only.
    process: dict[str, float] | None = None


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
    outputs: list[EngineCoreOutput]
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


Message = Union[Hello, AddRequest, Abort, Ready, Heartbeat, Outputs, Failed, Query, Status]


# ------------------------------------------------------------------ encode


def encode(msg: Message) -> bytes:
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def _to_wire(msg: Message) -> list[Any]:
    if isinstance(msg, Hello):
        return [HELLO, msg.frontend_index]
    if isinstance(msg, AddRequest):
        r = msg.request
        return [ADD, r.request_id, list(r.prompt_token_ids), dataclasses.asdict(r.params), float(r.arrival_time),
                int(r.priority), msg.frontend_index]
    if isinstance(msg, Abort):
        return [ABORT, list(msg.request_ids)]
    if isinstance(msg, Ready):
        return [READY, msg.engine_index, dataclasses.asdict(msg.model_info)]
    if isinstance(msg, Heartbeat):
        return [HEARTBEAT, msg.engine_index, dataclasses.asdict(msg.stats)]
    if isinstance(msg, Outputs):
        return [OUTPUTS, msg.engine_index, [_output_to_wire(o) for o in msg.outputs], dataclasses.asdict(msg.stats),
                [[t.request_id, t.queue_time, t.ttft, t.e2e] for t in msg.timings]]
    if isinstance(msg, Failed):
        return [FAILED, msg.engine_index, msg.message]
    if isinstance(msg, Query):
        return [QUERY, msg.query_id, list(msg.request_ids), msg.frontend_index]
    if isinstance(msg, Status):
        return [STATUS, msg.engine_index, msg.query_id, [dataclasses.asdict(s) for s in msg.statuses]]
    raise TypeError(f"not a protocol message: {type(msg).__name__}")


def _output_to_wire(o: EngineCoreOutput) -> list[Any]:
    logprobs = None
    if o.new_logprobs is not None:
        logprobs = [[[t, lp, rank] for t, (lp, rank) in entry.items()] for entry in o.new_logprobs]
    return [o.request_id, list(o.new_token_ids), o.finish_reason, o.stop_reason, logprobs, o.num_cached_tokens, o.error]


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


def _decode_add(request_id: Any, prompt: Any, params: Any, arrival: Any, priority: Any, frontend: Any) -> AddRequest:
    params = _map(params, "params")
    unknown = set(params) - _PARAM_FIELDS
    _check(not unknown, f"unknown sampling parameters: {', '.join(sorted(map(str, unknown)))}")
    request = EngineCoreRequest(
        _str(request_id, "request_id"),
        _int_list(prompt, "prompt_token_ids"),
        SamplingParams(**params),
        _float(arrival, "arrival_time"),
        _int(priority, "priority"),
    )
    return AddRequest(request, _index(frontend, "frontend_index"))


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
        elif f.name == "last_scan_stop":
            _check(value is None or isinstance(value, str), "stats.last_scan_stop must be a string or nil")
        elif f.name == "iteration_tokens":
            _int_list(value, "stats.iteration_tokens")
            _check(len(value) in (0, len(ITERATION_TOKENS_BUCKETS) + 1),
                   f"stats.iteration_tokens must have {len(ITERATION_TOKENS_BUCKETS) + 1} buckets")
            _check(all(c >= 0 for c in value), "stats.iteration_tokens must be non-negative")
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


def _decode_output(o: Any) -> EngineCoreOutput:
    _check(isinstance(o, list) and len(o) == 7, "an output must be an array of 7 fields")
    request_id, new, finish, stop_reason, logprobs, cached, error = o
    _check(finish is None or finish in _FINISH_REASONS, f"unknown finish_reason {finish!r}")
    _check(stop_reason is None or isinstance(stop_reason, (int, str)), "stop_reason must be an int, a string or nil")
    _check(error is None or isinstance(error, str), "error must be a string or nil")
    new_logprobs = None
    if logprobs is not None:
        _check(isinstance(logprobs, list), "logprobs must be an array")
        new_logprobs = []
        for entry in logprobs:
            _check(isinstance(entry, list), "a logprobs entry must be an array")
            row: dict[int, tuple[float, int]] = {}
            for item in entry:
                _check(isinstance(item, list) and len(item) == 3, "a logprob must be [token_id, logprob, rank]")
                row[_int(item[0], "token_id")] = (_float(item[1], "logprob"), _int(item[2], "rank"))
            new_logprobs.append(row)
    return EngineCoreOutput(
        _str(request_id, "request_id"),
        _int_list(new, "new_token_ids"),
        finish,
        stop_reason,
        new_logprobs,
        None if cached is None else _index(cached, "num_cached_tokens"),
        error,
    )


def _decode_timing(t: Any) -> RequestTiming:
    _check(isinstance(t, list) and len(t) == 4, "a timing must be [request_id, queue_time, ttft, e2e]")
    return RequestTiming(
        _str(t[0], "request_id"), _opt_float(t[1], "queue_time"), _opt_float(t[2], "ttft"), _opt_float(t[3], "e2e")
    )


def _decode_outputs(engine_index: Any, outputs: Any, stats: Any, timings: Any) -> Outputs:
    _check(isinstance(outputs, list), "outputs must be an array")
    _check(isinstance(timings, list), "timings must be an array")
    return Outputs(
        _index(engine_index, "engine_index"),
        [_decode_output(o) for o in outputs],
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
}
_ARITY = {HELLO: 1, ADD: 6, ABORT: 1, READY: 2, HEARTBEAT: 2, OUTPUTS: 4, FAILED: 2, QUERY: 3, STATUS: 3}
