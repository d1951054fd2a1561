"""Request traces for the simulator: read from JSONL, or the one ``fastsched bench serve`` sends.

A trace line is ``{"arrival_time": 0.25, "prompt_len": 512, "output_len": 128}`` with an
optional integer ``priority`` (lower = more urgent, as in the API). Arrival times are
seconds from the start of the run and need not be sorted.

The generated trace is built by ``bench_serve``'s own ``make_requests`` and
``arrival_times`` with the same seeds, token ids included, so a simulation with
``--qps Q --num-requests N --seed S`` replays exactly the requests that
``fastsched bench serve --qps Q --num-requests N --seed S`` sends, at the same instants
(identical prompts matter: they decide prefix-cache hits).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any

from fastsched.tools.simulator.jsonl import read_objects
from fastsched.tools.workload import DEFAULT_RANGE_RATIO, arrival_times, make_requests

DEFAULT_TOKEN_ID_RANGE = (10, 250)  # as bench serve's --token-id-range


@dataclass(frozen=True)
class TraceRequest:
    arrival_time: float  # seconds from the start of the run
    prompt_token_ids: tuple[int, ...]
    output_len: int
    priority: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def load_trace(
    path: str | os.PathLike[str], seed: int = 0, token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE
) -> list[TraceRequest]:
    """Reads a JSONL trace; prompts get random token ids (seeded) from ``token_id_range``.
    A bad line is a ``ValueError`` naming the file, the line and the field."""
    rng = random.Random(seed)
    requests = []
    for record, where in read_objects(path):
        arrival, prompt_len, output_len, priority = _parse_request(record, where)
        ids = tuple(rng.randrange(*token_id_range) for _ in range(prompt_len))
        requests.append(TraceRequest(arrival, ids, output_len, priority))
    if not requests:
        raise ValueError(f"{os.fspath(path)}: the trace has no requests")
    return sorted(requests, key=lambda r: r.arrival_time)


def _parse_request(record: dict[str, Any], where: str) -> tuple[float, int, int, int]:
    for name in ("arrival_time", "prompt_len", "output_len"):
        if name not in record:
            raise ValueError(f"{where}: missing field {name!r}")
    arrival = record["arrival_time"]
    if (
        isinstance(arrival, bool)
        or not isinstance(arrival, (int, float))
        or not math.isfinite(arrival)
        or arrival < 0
    ):
        raise ValueError(f"{where}: field 'arrival_time' must be a number of seconds >= 0, got {arrival!r}")
    for name in ("prompt_len", "output_len"):
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: field {name!r} must be an integer >= 1, got {value!r}")
    priority = record.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"{where}: field 'priority' must be an integer, got {priority!r}")
    return float(arrival), record["prompt_len"], record["output_len"], priority


def bench_trace(
    num_requests: int,
    qps: float,
    prompt_len: int,
    output_len: int,
    seed: int = 0,
    rate_index: int = 0,
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
    range_ratio: float = DEFAULT_RANGE_RATIO,
) -> list[TraceRequest]:
    """The requests ``fastsched bench serve`` sends at its ``rate_index``-th ``--qps`` value."""
    requests = make_requests(num_requests, prompt_len, output_len, seed, token_id_range, range_ratio)
    times = arrival_times(num_requests, qps, seed + 1 + rate_index)  # run_bench's seed per rate
    return [TraceRequest(t, tuple(r.prompt_token_ids), r.max_tokens) for r, t in zip(requests, times)]
