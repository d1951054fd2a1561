"""Capacity planning: from a load and a model to the four sizing knobs (docs/design.md §3, §6).

Pure arithmetic, no torch and no I/O, so every number can be checked by hand. The
reasoning follows the seed article's §8 ("配置不再是玄学"):

1. **Concurrency lower bound (Little's law).** In steady state the mean number of
   requests in a system is ``L = λ · W``. A request's service time is its prefill
   plus its decode, ``S = L_prompt / T_p + L_out · t_d``, so a replica that receives
   ``λ / D`` requests per second holds on average
   ``C = (λ / D) · L_out · t_d + (λ / D) · L_prompt / T_p`` of them at once (decode
   and prefill shares). Fewer running slots than that and the replica cannot finish
   requests as fast as they arrive: the waiting queue grows without bound.
2. **KV upper bound (memory).** A request of ``L_prompt + L_out`` tokens holds
   ``ceil((L_prompt + L_out) / block_size)`` blocks of
   ``2 · layers · kv_heads · head_dim · dtype_bytes · block_size`` bytes (K and V for
   every layer). The replica's KV pool holds ``kv_memory // bytes_per_block`` blocks,
   hence at most ``num_blocks // blocks_per_request`` such requests at once. More
   running requests than that means preemption, not more throughput.
3. If the lower bound exceeds the upper bound, **no setting serves the load**: add
   replicas or shorten the context. Otherwise ``max_num_seqs`` goes between them,
   with headroom for bursts, and the two admission limits are sized from the TTFT
   target.

All concurrency figures are per replica (each engine has its own scheduler and KV
pool); the arrival rate and the admission limits are for the whole server.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

# Bytes per KV element; the names are the engine's --dtype choices.
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_HEADROOM = 1.2
SLOT_MULTIPLE = 8  # max_num_seqs rounded up to this: buffer and CUDA-graph batch sizes like multiples of 8

STATUS_OK = "ok"
STATUS_TIGHT = "tight"
STATUS_NOT_SERVABLE = "not servable"

_EPS = 1e-9  # float products such as 20 * 0.5 * 1.0 may land a hair above an integer


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class PlanInputs:
    """A load, a model's KV shape and a deployment. Validated on construction; a
    message names the CLI flag (``fastsched plan --...``) of the bad value."""

    arrival_rate: float  # λ, requests/s arriving at the whole server
    prompt_len: float  # mean prompt tokens (L_prompt)
    output_len: float  # mean output tokens (L_out)
    decode_step_time: float  # seconds per decode step of one replica at its running batch size (t_d)
    prefill_throughput: float  # prompt tokens/s one replica prefills, measured under mixed load (T_p)
    ttft_slo: float  # TTFT target, seconds
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_memory: int  # bytes of KV pool per replica (after weights and activations)
    dtype: str = "bfloat16"  # KV cache element type
    data_parallel_size: int = 1  # D engine replicas, each with its own KV pool
    block_size: int = 16
    api_server_count: int = 1  # K frontends; A3 counts queued tokens per frontend
    headroom: float = DEFAULT_HEADROOM  # max_num_seqs target = headroom × lower bound
    max_model_len: int | None = None  # the model's context length, when known

    def __post_init__(self) -> None:
        positive = {
            "arrival_rate": "--arrival-rate",
            "prompt_len": "--prompt-len",
            "output_len": "--output-len",
            "decode_step_time": "--decode-step-time",
            "prefill_throughput": "--prefill-throughput",
            "ttft_slo": "--ttft-slo",
            "kv_memory": "--kv-memory",
            "num_layers": "--model (num_layers)",
            "num_kv_heads": "--model (num_kv_heads)",
            "head_dim": "--model (head_dim)",
        }
        for name, flag in positive.items():
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{flag} must be a positive number, got {value!r}")
        at_least_one = {
            "data_parallel_size": "--data-parallel-size",
            "block_size": "--block-size",
            "api_server_count": "--api-server-count",
        }
        for name, flag in at_least_one.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {', '.join(KV_DTYPE_BYTES)}, got {self.dtype!r}")
        if not (
            isinstance(self.headroom, (int, float)) and math.isfinite(self.headroom) and self.headroom >= 1
        ):
            raise ValueError(f"--headroom must be at least 1, got {self.headroom!r}")
        if self.max_model_len is not None and self.prompt_len + self.output_len > self.max_model_len:
            raise ValueError(
                f"--prompt-len + --output-len ({self.prompt_len:g} + {self.output_len:g}) is longer than "
                f"the model's context length ({self.max_model_len})"
            )

    @property
    def dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Plan:
    """Every derived number of a plan. Concurrency and KV figures are per replica."""

    inputs: PlanInputs
    # Load.
    arrival_rate_per_replica: float  # λ / D
    prefill_time: float  # L_prompt / T_p, seconds
    decode_time: float  # L_out · t_d, seconds
    service_time: float  # S = prefill_time + decode_time
    # Little's law, per replica.
    decode_concurrency: float  # C_d = (λ / D) · L_out · t_d
    prefill_concurrency: float  # C_p = (λ / D) · L_prompt / T_p
    concurrency_lower_bound: float  # C_d + C_p
    required_seqs: int  # ceil(lower bound): fewest running slots that keep up
    # KV, per replica.
    kv_bytes_per_token: int  # 2 · layers · kv_heads · head_dim · dtype_bytes
    kv_bytes_per_block: int  # kv_bytes_per_token · block_size
    tokens_per_request: int  # ceil(L_prompt + L_out)
    blocks_per_request: int  # ceil(tokens_per_request / block_size)
    kv_bytes_per_request: int  # blocks_per_request · kv_bytes_per_block
    num_kv_blocks: int  # kv_memory // kv_bytes_per_block
    kv_upper_bound: int  # num_kv_blocks // blocks_per_request
    # Verdict.
    status: str  # ok | tight | not servable
    servable: bool
    min_data_parallel_size: (
        int | None
    )  # fewest replicas whose lower bound fits; None if one request never fits
    max_context_tokens: int  # longest request (prompt + output) whose KV bound still covers required_seqs
    # Recommendations (None when not even one request fits in the KV pool).
    max_num_seqs: int | None
    max_num_active_seqs: int | None
    max_num_queued_tokens: int  # per frontend (A3 counts per frontend)
    max_num_queued_reqs: int | None  # whole server (A2 sums all frontends)
    queue_headroom: int  # ceil(λ · TTFT target)
    verdict: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the inputs (with dtype_bytes) and every derived number."""
        out = asdict(self)
        out["inputs"]["dtype_bytes"] = self.inputs.dtype_bytes
        return out


def plan(inputs: PlanInputs) -> Plan:
    """The plan for ``inputs``; the module docstring explains the two bounds.

    Recommendations, with ``lower`` and ``upper`` the per-replica bounds:

    - ``max_num_seqs = min(round_up_8(ceil(headroom · lower)), upper)``: the lower bound
      plus burst headroom (×1.2 by default), in slots of 8; the KV bound may clip the
      headroom (status "tight") but never the lower bound. When the load is not
      servable it is ``upper``: the replica runs at its KV capacity and the queue
      limits shed the rest with 503s.
    - ``max_num_active_seqs = min(max_num_seqs, upper)``: RUNNING requests hold KV, so
      admitting more than the pool holds only buys preemptions.
    - ``max_num_queued_tokens ≈ TTFT · D · T_p / K`` (docs/design.md §6): a new prompt waits
      behind the queued prefill tokens, which the server drains at ``D · T_p``; A3
      counts them per frontend, hence the split over ``K`` frontends.
    - ``max_num_queued_reqs ≈ D · max_num_active_seqs + ceil(λ · TTFT)`` (docs/design.md §6):
      A2 counts every unfinished request over all frontends, i.e. the running ones
      plus a waiting queue; that queue drains at about λ requests/s, so λ · TTFT
      waiting requests can still start within the target.
    - ``min_data_parallel_size = ceil(λ · S / upper)``: replicas needed for the lower
      bound to fit; ``max_context_tokens``: the longest request (prompt + output) whose
      KV bound still covers ``ceil(lower)`` (conservative: a shorter context also
      shortens S).
    """
    i = inputs
    d = i.data_parallel_size
    rate = i.arrival_rate / d
    prefill_time = i.prompt_len / i.prefill_throughput
    decode_time = i.output_len * i.decode_step_time
    decode_conc = rate * decode_time
    prefill_conc = rate * prefill_time
    lower = decode_conc + prefill_conc
    required = max(_ceil(lower), 1)

    # Conservative: a request is charged its whole final context for its whole life,
    # as it holds it at the end, and the last block is charged whole (blocks are the unit).
    per_token = 2 * i.num_layers * i.num_kv_heads * i.head_dim * i.dtype_bytes
    per_block = per_token * i.block_size
    tokens = _ceil(i.prompt_len + i.output_len)
    blocks_per_req = -(-tokens // i.block_size)
    num_blocks = i.kv_memory // per_block
    upper = num_blocks // blocks_per_req

    servable = required <= upper
    # Slots wanted: the lower bound plus burst headroom, rounded up to a multiple of 8.
    with_headroom = max(_ceil(i.headroom * lower), 1)
    wanted = _round_up(with_headroom, SLOT_MULTIPLE)
    if upper < 1:
        max_num_seqs = None
    elif servable:
        # The KV bound clips the headroom, never the lower bound: lower ≤ seqs ≤ upper.
        max_num_seqs = min(wanted, upper)
    else:
        # Best effort: run the replica at its KV capacity; the queue limits shed the rest (503s).
        max_num_seqs = upper
    # max_num_active_seqs caps RUNNING, the state that holds KV: never above the KV bound.
    max_num_active_seqs = None if max_num_seqs is None else min(max_num_seqs, upper)
    if not servable:
        status = STATUS_NOT_SERVABLE
    elif max_num_seqs is not None and max_num_seqs < with_headroom:
        status = STATUS_TIGHT
    else:
        status = STATUS_OK

    # A3: a new prompt waits behind the queued prefill tokens, drained at D · T_p over the
    # server, so a backlog of TTFT · D · T_p tokens keeps TTFT near the target (docs/design.md §6).
    # Each frontend counts only its own backlog, so the server-wide figure is split over K.
    server_queued_tokens = i.ttft_slo * d * i.prefill_throughput
    max_num_queued_tokens = max(_ceil(server_queued_tokens / i.api_server_count), 1)
    # A2: in flight = running (D × max_num_seqs) + waiting. The waiting queue drains at about
    # λ requests/s in steady state, so λ · TTFT waiting requests can still start within the target.
    queue_headroom = max(_ceil(i.arrival_rate * i.ttft_slo), 1)
    max_num_queued_reqs = None if max_num_active_seqs is None else d * max_num_active_seqs + queue_headroom

    total_lower = i.arrival_rate * (prefill_time + decode_time)
    min_dp = max(_ceil(total_lower / upper), 1) if upper >= 1 else None
    max_context_tokens = (num_blocks // required) * i.block_size

    notes: list[str] = []
    if prefill_time > i.ttft_slo:
        notes.append(
            f"the TTFT target ({i.ttft_slo:g} s) is shorter than one mean prompt's prefill "
            f"({prefill_time:.3g} s at {i.prefill_throughput:g} tok/s): even an idle replica misses it"
        )
    if max_num_queued_tokens < i.prompt_len:
        notes.append(
            f"max_num_queued_tokens ({max_num_queued_tokens}) is below one mean prompt ({i.prompt_len:g} tokens): "
            "A3 will admit about one prefill at a time per frontend"
        )

    verdict = _verdict(
        status,
        i,
        lower,
        required,
        upper,
        min_dp,
        max_context_tokens,
        with_headroom,
        required * blocks_per_req * per_block,
    )
    return Plan(
        inputs=i,
        arrival_rate_per_replica=rate,
        prefill_time=prefill_time,
        decode_time=decode_time,
        service_time=prefill_time + decode_time,
        decode_concurrency=decode_conc,
        prefill_concurrency=prefill_conc,
        concurrency_lower_bound=lower,
        required_seqs=required,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
        tokens_per_request=tokens,
        blocks_per_request=blocks_per_req,
        kv_bytes_per_request=blocks_per_req * per_block,
        num_kv_blocks=num_blocks,
        kv_upper_bound=upper,
        status=status,
        servable=servable,
        min_data_parallel_size=min_dp,
        max_context_tokens=max_context_tokens,
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_queued_tokens=max_num_queued_tokens,
        max_num_queued_reqs=max_num_queued_reqs,
        queue_headroom=queue_headroom,
        verdict=verdict,
        notes=tuple(notes),
    )


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``40.00 GiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:g} B"


def _verdict(
    status: str,
    i: PlanInputs,
    lower: float,
    required: int,
    upper: int,
    min_dp: int | None,
    max_context_tokens: int,
    with_headroom: int,
    needed_kv_bytes: int,
) -> str:
    where = f"per replica (D = {i.data_parallel_size})"
    if status == STATUS_OK:
        return (
            f"servable: {required} concurrent requests needed {where}, the KV pool holds {upper}; "
            f"max_num_seqs leaves at least {i.headroom:g}x headroom"
        )
    if status == STATUS_TIGHT:
        return (
            f"servable but tight: {required} concurrent requests needed {where}, the KV pool holds only {upper} "
            f"(less than the {with_headroom} wanted for {i.headroom:g}x headroom); "
            "bursts will queue and TTFT will rise"
        )
    fixes = []
    if min_dp is not None:
        fixes.append(f"add replicas (--data-parallel-size {min_dp} or more)")
    if max_context_tokens >= i.block_size:
        fixes.append(
            f"shorten the context to at most {max_context_tokens} tokens per request (prompt + output)"
        )
    fixes.append(f"give each replica at least {format_bytes(needed_kv_bytes)} of KV memory")
    return (
        f"not servable: the concurrency lower bound {lower:.1f} (Little's law) exceeds the KV upper bound "
        f"{upper} {where}; no setting can serve this load: " + ", or ".join(fixes)
    )
