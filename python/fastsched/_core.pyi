"""Type stubs for ``fastsched._core``, the PyO3 binding of the Rust scheduler
core (``rust/fastsched-py``). Rule ids (S1, S7, ...) refer to docs/design.md §5.

Requests are named by *handles*: small integers (``u32``) that index the
scheduler's request slab, so per-step data crosses the binding as numpy arrays
of integers instead of one Python object per request. A handle stays valid
until the ``schedule()`` after the one that reported it in ``finished``; it may
be reused for a new request after that.

The API the engine uses for speculative decoding, LoRA and pauses
(``docs/scheduler.md``, S2, S7, S13):

- **Drafts** (``num_speculative_tokens = k > 0``). After a step's update, hand each
  request that sampled its drafts for the next step:
  ``update_draft_token_ids(handles, draft_offsets, draft_token_ids)`` (CSR, uint32, at
  most ``k`` per row), or the same rows, aligned with the step's ``req_handles``, as
  the ``draft_offsets``/``draft_token_ids`` of ``update_from_output``. The next
  ``schedule()`` verifies ``num_spec_tokens[i]`` of them for row ``i``, listed in
  ``spec_token_ids`` (int64, row after row; ``-1`` pads a one-token admission to a
  uniform decode and is never accepted). The model returns, in row ``i`` of
  ``update_from_output``, the accepted drafts followed by its own token
  (``a + 1`` tokens); the rejected ``num_spec_tokens[i] - a`` are rolled back.
  ``num_lookahead_tokens`` reserves KV and input slots for a drafter that writes KV
  for its drafts (0 for n-gram drafts, ``k`` for EAGLE-like ones).
- **LoRA** (``max_loras > 0``). ``add_request(..., lora_id=id)``, ``id >= 1``. At most
  ``max_loras`` adapters are in the running batch; a waiting request whose adapter
  would exceed it is skipped for the step (``SchedulerOutput.skipped``, reason 0
  ``lora_slots``) and keeps its place. Adapters never share prefix-cache blocks.
- **Pause** (``set_pause_state``). ``"paused_new"``: running requests go on, nobody is
  admitted; ``"paused_all"``: nothing is scheduled; ``"unpaused"``. ``has_requests()``
  follows the state, so an engine stepping while it is true idles while paused.
"""

from collections.abc import Sequence
from typing import Any, Literal, TypedDict, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "SchedulerConfig",
    "Scheduler",
    "SchedulerOutput",
    "EngineCoreOutputs",
    "SharedAdmissionStats",
    "BlockHasher",
    "KIND_CACHED",
    "KIND_NEW",
    "KIND_RESUMED",
    "FINISH_REASONS",
    "__version__",
    "set_kernel_threads",
    "kernel_threads",
    "kernel_isa",
    "QuantWeight",
    "quant_matmul",
    "quant_dequantize_bf16",
    "quant_gemm_simd",
    "quant_gemm_bf16",
    "paged_attention",
    "add_rms_norm_bf16",
    "rope",
    "silu_mul_bf16",
    "gelu_tanh_mul_bf16",
    "rms_norm_heads_bf16",
    "CpuDecoder",
]

__version__: str
"""Version of the ``fastsched-py`` crate the extension was built from."""
KIND_CACHED: int
"""``SchedulerOutput.kinds``: already known to the runner; only new block ids are sent."""
KIND_NEW: int
"""``SchedulerOutput.kinds``: scheduled for the first time; the whole block table is sent."""
KIND_RESUMED: int
"""``SchedulerOutput.kinds``: re-admitted after a preemption; the whole block table is sent again."""
FINISH_REASONS: dict[int, str]
"""``EngineCoreOutputs.finish_reasons`` code -> name (``stop``, ``length``, ``abort``,
``ignored``); 0 means not finished."""

_TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]
_Policy = Literal["fcfs", "priority"]
_PauseState = Literal["unpaused", "paused_new", "paused_all"]
_LiveStatus = Literal[
    "waiting", "waiting_for_remote_kvs", "waiting_for_streaming_req", "running", "preempted"
]
_Status = (
    _LiveStatus
    | Literal["finished_stopped", "finished_length_capped", "finished_aborted", "finished_ignored"]
)

_ScanStop = Literal[
    "active_seqs",
    "token_budget",
    "kv_blocks",
    "draft_slots",
    "paused",
    "prefill_interval",
    "no_waiting",
    "preempted",
]
_SkipReason = Literal["lora_slots", "remote_kv", "stale_output"]

class _SchedulerStats(TypedDict):
    """``Scheduler.stats()``: counters and gauges for metrics (docs/design.md §7)."""

    num_running: int
    num_waiting: int
    num_waiting_for_streaming_input: int
    kv_cache_usage: float
    """Fraction of usable KV blocks held by requests, in [0, 1]."""
    num_free_blocks: int
    num_preemptions_total: int
    prefix_cache_requests: int
    """Prefix-cache lookups by requests never preempted."""
    prefix_cache_queries: int
    """Tokens looked up by those requests."""
    prefix_cache_hits: int
    """Tokens found cached by those requests."""
    prefix_cache_preempted_queries: int
    """Tokens looked up by resumed (preempted) requests, kept apart from new traffic."""
    prefix_cache_preempted_hits: int
    num_steps: int
    """``schedule()`` calls so far."""
    scan_stops_total: dict[_ScanStop, int]
    """Why each step's waiting scan stopped (or did not run): one per ``schedule()``, so
    the counts sum to ``num_steps``. Every gate is present. See docs/scheduler.md, "Gate telemetry"."""
    skips_total: dict[_SkipReason, int]
    """Waiting requests skipped (S7), one per skipped request per step. Every reason is present."""
    last_scan_stop: _ScanStop | None
    """The gate of the latest ``schedule()``; None before the first."""

class _RequestInfo(TypedDict):
    """``Scheduler.request_info()``: one request's state (diagnostics)."""

    request_id: str
    status: _Status
    num_tokens: int
    """Prompt plus output tokens (plus later streaming input)."""
    num_prompt_tokens: int
    num_output_tokens: int
    """Outputs of the current generation segment."""
    num_computed_tokens: int
    """Tokens whose KV is computed (or scheduled to be, this step)."""
    is_prefill_chunk: bool
    """Its last schedule left prompt to compute (S12 holds such a request)."""
    num_cached_tokens: int | None
    """Prefix-cache (and remote) hit of the first admission; None before it."""
    num_preemptions: int
    priority: int
    blocks: list[int]
    """KV block ids the request holds, in order."""
    ignore_reason: str | None

@final
class SchedulerConfig:
    """Scheduler settings (docs/design.md §3), validated at construction: a broken value or
    relation raises ``ValueError`` naming both values, e.g.
    ``max_num_active_seqs (300) cannot be greater than max_num_seqs (256)``.
    Immutable. Only the settings below have getters. ``SchedulerConfig()`` holds the core's
    defaults, which ``fastsched.config.EngineConfig`` takes as its own."""

    def __new__(
        cls,
        *,
        max_num_seqs: int | None = None,
        max_num_active_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_scheduled_tokens: int | None = None,
        max_model_len: int | None = None,
        long_prefill_token_threshold: int | None = None,
        long_prefill_token_threshold_adaptive: bool | None = None,
        prefill_schedule_interval: int | None = None,
        enable_chunked_prefill: bool | None = None,
        policy: _Policy | None = None,
        max_loras: int | None = None,
        num_speculative_tokens: int | None = None,
        num_lookahead_tokens: int | None = None,
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        enable_prefix_caching: bool | None = None,
        prefix_caching_hash_algo: Literal["builtin", "sha256"] | None = None,
        scheduler_reserve_full_isl: bool | None = None,
        watermark: float | None = None,
        priority_preemption: bool | None = None,
        max_preemptions_per_request: int | None = None,
    ) -> SchedulerConfig:
        """All settings are keyword-only and optional: ``None`` (or leaving one out) takes
        the core's default, defined once, in Rust (``SchedulerConfig::default()``, after
        DESIGN §3); the getters show the values in use.

        - ``max_num_seqs``: model-runner request slots (per-request buffers, CUDA-graph sizes).
        - ``max_num_active_seqs``: admission cap into RUNNING (S6), ``<= max_num_seqs``; unset = ``max_num_seqs``.
        - ``max_num_batched_tokens``: input budget per step, in tokens (S1), ``>= max_num_seqs``.
        - ``max_num_scheduled_tokens``: compute budget per step in tokens; unset = ``max_num_batched_tokens``.
        - ``max_model_len``: prompt + output limit per request, in tokens.
        - ``long_prefill_token_threshold``: per-request token cap per step (S9), 0 = off.
        - ``long_prefill_token_threshold_adaptive``: raise that cap to ``input budget // (running + waiting)``.
        - ``prefill_schedule_interval``: run prefill only every k-th executed step while decoding (S12), 1 = off.
        - ``enable_chunked_prefill``: allow a prompt to span steps; without it the input budget must
          cover ``max_model_len``.
        - ``policy``: ``"fcfs"`` or ``"priority"`` (lower number = more urgent).
        - ``max_loras``: LoRA adapters active in one batch (every running request counts), 0 = no LoRA.
        - ``num_speculative_tokens``: ``k``, drafts a decoding request may carry into a step for
          verification (speculative decoding), 0 = off.
        - ``num_lookahead_tokens``: KV slots reserved past each request's scheduled tokens, and input
          slots kept free at admission, for a drafter that writes KV for its drafts (``k`` for
          EAGLE-like drafters); 0 for n-gram or caller-supplied drafts (vLLM's behaviour).
        - ``block_size``: tokens per KV block (also the prefix-cache hash granularity).
        - ``num_gpu_blocks``: KV blocks in the pool *including* the reserved null block 0.
        - ``enable_prefix_caching``: reuse cached whole blocks at admission (S8).
        - ``prefix_caching_hash_algo``: ``"builtin"`` (a fast 64-bit hash) or ``"sha256"`` (the
          first 8 bytes of SHA-256, hard to forge: for blocks shared through a KV store).
        - ``scheduler_reserve_full_isl``: admit only if the whole current sequence fits in free KV (S10).
        - ``watermark``: fraction of the pool, in [0, 1), kept free when admitting (S10).
        - ``priority_preemption``: when the active set is full, a strictly more urgent waiting request
          preempts the worst running one (recompute); requires ``policy="priority"``.
        - ``max_preemptions_per_request``: a request already preempted this many times is never
          a priority-preemption victim.
        """

    @property
    def max_num_seqs(self) -> int:
        """Model-runner request slots."""
    @property
    def max_num_active_seqs(self) -> int:
        """Admission cap into RUNNING, resolved (``max_num_seqs`` when not set)."""
    @property
    def max_num_batched_tokens(self) -> int:
        """Input budget per step, in tokens."""
    @property
    def max_num_scheduled_tokens(self) -> int:
        """Compute budget per step, in tokens, resolved (``max_num_batched_tokens`` when not set)."""
    @property
    def max_model_len(self) -> int:
        """Prompt + output limit per request, in tokens."""
    @property
    def long_prefill_token_threshold(self) -> int:
        """Per-request token cap per step (S9), 0 = off."""
    @property
    def long_prefill_token_threshold_adaptive(self) -> bool:
        """Whether the cap rises to the fair share of the budget."""
    @property
    def prefill_schedule_interval(self) -> int:
        """Prefill only every k-th executed step while decoding (S12), 1 = off."""
    @property
    def enable_chunked_prefill(self) -> bool:
        """Whether a prompt may span steps."""
    @property
    def scheduler_reserve_full_isl(self) -> bool:
        """Whether admission needs the whole current sequence to fit in free KV (S10)."""
    @property
    def watermark(self) -> float:
        """Fraction of the pool kept free when admitting (S10)."""
    @property
    def max_loras(self) -> int:
        """LoRA adapters active in one batch, 0 = no LoRA."""
    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per request per step, 0 = no speculative decoding."""
    @property
    def num_lookahead_tokens(self) -> int:
        """KV and input slots reserved for a drafter that writes KV for its drafts."""
    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
    @property
    def num_gpu_blocks(self) -> int:
        """KV blocks in the pool, including the null block 0 (so ``num_gpu_blocks - 1`` are usable)."""
    @property
    def enable_prefix_caching(self) -> bool:
        """Whether admission reuses cached prefix blocks."""
    @property
    def prefix_caching_hash_algo(self) -> Literal["builtin", "sha256"]:
        """How block hashes are computed."""
    @property
    def priority_preemption(self) -> bool:
        """Whether a more urgent waiting request preempts the worst running one."""
    @property
    def max_preemptions_per_request(self) -> int:
        """Preemptions after which a request is no longer a priority-preemption victim."""
    @property
    def policy(self) -> _Policy:
        """``"fcfs"`` or ``"priority"``."""

@final
class SchedulerOutput:
    """One step's decisions (one forward pass), as parallel arrays indexed by
    scheduled position ``i`` in ``[0, num_reqs)``. Read-only."""

    def __len__(self) -> int:
        """``num_reqs``."""
    @property
    def step_id(self) -> int:
        """Increases by one per ``schedule()``; updates consume steps in this order."""
    @property
    def num_reqs(self) -> int:
        """Requests scheduled this step."""
    @property
    def total_num_scheduled_tokens(self) -> int:
        """Sum of ``num_scheduled_tokens``."""
    @property
    def req_handles(self) -> npt.NDArray[np.uint32]:
        """Handle of the request at each scheduled position."""
    @property
    def num_scheduled_tokens(self) -> npt.NDArray[np.uint32]:
        """Tokens to compute this step, per request (always > 0)."""
    @property
    def num_computed_tokens(self) -> npt.NDArray[np.uint32]:
        """Tokens computed before this step: the position of the first scheduled token."""
    @property
    def kinds(self) -> npt.NDArray[np.uint8]:
        """0 = cached (known to the runner: only new blocks are sent), 1 = new
        (scheduled for the first time), 2 = resumed (re-admitted after a
        preemption or a streaming segment: the whole block table is sent again)."""
    @property
    def num_cached_tokens(self) -> npt.NDArray[np.uint32]:
        """For kinds 1 and 2: tokens counted as computed at admission (prefix-cache
        and remote hit, in tokens); 0 for kind 0."""
    @property
    def num_spec_tokens(self) -> npt.NDArray[np.uint32]:
        """Draft tokens scheduled for verification, per request (speculative decoding);
        ``num_scheduled_tokens[i] - num_spec_tokens[i]`` are real tokens."""
    @property
    def spec_token_ids(self) -> npt.NDArray[np.int64]:
        """The drafts to verify, row after row: ``num_spec_tokens[i]`` for row ``i`` (offsets
        are ``np.cumsum(num_spec_tokens)``). A prefix of the drafts the request was given,
        or ``-1`` padding: a one-token admission padded to a uniform decode (never accepted)."""
    @property
    def block_offsets(self) -> npt.NDArray[np.uint32]:
        """CSR offsets (``num_reqs + 1`` entries) into ``block_ids``."""
    @property
    def block_ids(self) -> npt.NDArray[np.uint32]:
        """KV block ids: request ``i`` owns ``block_ids[block_offsets[i]:block_offsets[i+1]]``,
        its whole block table for kinds 1 and 2, only the blocks added this step for kind 0."""
    @property
    def preempted(self) -> npt.NDArray[np.uint32]:
        """Handles preempted during this ``schedule()`` (S4): they lost their KV and wait again."""
    @property
    def skipped(self) -> npt.NDArray[np.uint32]:
        """Waiting requests this ``schedule()`` skipped for a reason of their own (S7), each
        once, in the order met; they keep their place in the queue."""
    @property
    def skip_reasons(self) -> npt.NDArray[np.uint8]:
        """Why each of ``skipped`` was skipped: 0 ``lora_slots`` (its adapter would exceed
        ``max_loras``), 1 ``remote_kv`` (its KV load is not done), 2 ``stale_output``
        (an output is still in flight)."""
    @property
    def finished(self) -> npt.NDArray[np.uint32]:
        """Handles finished, aborted or ignored since the previous ``schedule()``: the
        runner drops their state; the handles may be reused after this step."""

@final
class EngineCoreOutputs:
    """What one update produced, for the requests that progressed (or finished),
    as parallel arrays indexed by ``i`` in ``[0, num_reqs)``. Read-only."""

    def __len__(self) -> int:
        """``num_reqs``."""
    @property
    def num_reqs(self) -> int:
        """Requests reported by this update."""
    @property
    def handles(self) -> npt.NDArray[np.uint32]:
        """Handle of each reported request."""
    @property
    def token_offsets(self) -> npt.NDArray[np.uint32]:
        """CSR offsets (``num_reqs + 1`` entries) into ``token_ids``."""
    @property
    def token_ids(self) -> npt.NDArray[np.uint32]:
        """New tokens: request ``i`` got ``token_ids[token_offsets[i]:token_offsets[i+1]]``."""
    @property
    def finish_reasons(self) -> npt.NDArray[np.uint8]:
        """0 = still running, 1 = stop (EOS or a stop token id), 2 = length
        (``max_tokens`` or ``max_model_len``), 3 = abort, 4 = ignored (the prompt
        can never fit: longer than ``max_model_len`` or the whole KV pool)."""
    @property
    def segment_ended(self) -> npt.NDArray[np.bool_]:
        """A streaming-input session finished a segment and now waits for input (S15)."""
    @property
    def num_cached_tokens(self) -> npt.NDArray[np.int64]:
        """Prefix-cache hit of the first admission, in tokens; -1 while the prompt
        is not yet fully computed."""

@final
class Scheduler:
    """The per-step scheduler (docs/design.md §5). One ``schedule()`` per forward pass,
    then one ``update_from_output()`` (or ``update_from_tokens()``) with what the
    model sampled for that step. Both run with the GIL released."""

    def __new__(cls, config: SchedulerConfig) -> Scheduler: ...
    @property
    def config(self) -> SchedulerConfig:
        """A copy of the configuration in use."""
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: _TokenIds,
        max_tokens: int,
        *,
        min_tokens: int = 0,
        eos_token_id: int | None = None,
        stop_token_ids: _TokenIds | None = None,
        ignore_eos: bool = False,
        priority: int = 0,
        arrival_time: float = 0.0,
        lora_id: int | None = None,
        streaming: bool = False,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> int:
        """Queues a request and returns its handle.

        ``max_tokens == 0`` is a prefill-only request (S20): it ends, length-capped and
        with no token, in the step that computes its last prompt token.
        ``skip_reading_prefix_cache`` (S19) gives it no prefix-cache hit and no
        KV-connector tokens: every position is computed (and still cached for others).

        ``ValueError`` (naming the field) for an empty prompt, a token id outside
        ``[0, 2**32)``, ``max_tokens < 1`` for a streaming session, ``min_tokens > max_tokens``, a
        non-finite ``arrival_time``, or a ``request_id`` already live. A prompt
        that can never run (``>= max_model_len`` tokens, or more blocks than the
        whole pool) is accepted but finished as ignored at once: it is in the next
        ``schedule()``'s ``finished`` and the next update reports finish reason 4;
        see ``ignore_reason()``. ``priority``: lower = more urgent (priority
        policy). ``arrival_time``: seconds, any clock, orders equal priorities.
        ``lora_id``: the request's LoRA adapter (``>= 1``; None = the base model), which
        counts against ``max_loras`` (S7) and keys its prefix-cache blocks (S8).
        ``streaming``: a session that waits for more input after each segment (S15).
        ``cache_salt``: mixed into the root of the request's block hashes, so that requests
        with different salts (tenants) never share prefix-cache blocks (S8).
        """
    def abort_request(self, request_id: str) -> _LiveStatus | None:
        """Aborts a live request and frees its blocks at once (S18); returns its status
        just before the abort, or None for an unknown or already finished id (a no-op).
        The abort is reported in the next ``schedule()``'s ``finished``, never as a
        finish by the model."""
    def schedule(self) -> SchedulerOutput:
        """Decides the next step (S1–S14)."""
    def update_from_output(
        self,
        sampled_offsets: npt.NDArray[np.uint32],
        sampled_token_ids: npt.NDArray[np.uint32],
        draft_offsets: npt.NDArray[np.uint32] | None = None,
        draft_token_ids: npt.NDArray[np.uint32] | None = None,
    ) -> EngineCoreOutputs:
        """Feeds the sampled tokens of the oldest step in flight, as CSR aligned with
        that step's ``req_handles`` (an empty row for a partial prefill), plus
        optional draft proposals for the next step in the same layout (S17).
        Appends tokens, applies stop conditions and frees finished requests at once.
        ``ValueError`` when no step is in flight or the arrays do not match the step
        (``len(sampled_offsets) != num_reqs + 1``, offsets not starting at 0,
        decreasing, or not ending at ``len(sampled_token_ids)``); the step then stays
        in flight. ``TypeError`` for arrays that are not contiguous uint32."""
    def update_draft_token_ids(
        self,
        handles: npt.NDArray[np.uint32],
        draft_offsets: npt.NDArray[np.uint32],
        draft_token_ids: npt.NDArray[np.uint32],
    ) -> None:
        """Speculative decoding: the drafts proposed for the next step, as CSR rows aligned
        with ``handles`` (``len(draft_offsets) == len(handles) + 1``), after the step's
        update, as vLLM's ``EngineCore.post_step``. A running request whose prefill is
        complete takes its row (at most ``num_speculative_tokens``), replacing older
        drafts; one still in prefill drops its drafts; finished, waiting or unknown
        handles are ignored, and so is everything when ``num_speculative_tokens`` is 0.
        ``ValueError`` for mismatched offsets."""
    def update_from_tokens(self, tokens: npt.NDArray[np.int64]) -> EngineCoreOutputs:
        """The common case of ``update_from_output``: one sampled token per scheduled
        request, -1 for none (a partial prefill)."""
    def has_requests(self) -> bool:
        """Whether the engine should call ``schedule()``: any request the pause state
        lets run (all waiting and running ones when unpaused, running and KV-holding
        ones under ``"paused_new"``, none under ``"paused_all"``), or any finish/abort not
        yet reported by a ``schedule()`` (S13, S18)."""
    @property
    def num_running(self) -> int:
        """Requests in RUNNING."""
    @property
    def num_waiting(self) -> int:
        """Waiting requests, preempted and KV-holding ones included."""
    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks, cached-but-unreferenced (evictable) ones included, the null block excluded."""
    @property
    def num_waiting_for_streaming_input(self) -> int:
        """Streaming sessions waiting for input; they keep their runner slot (S6, S15)."""
    def stats(self) -> _SchedulerStats:
        """Counters and gauges for metrics."""
    def request_id(self, handle: int) -> str:
        """The id of a handle still in the slab; ``KeyError`` otherwise."""
    def request_ids(self, handles: npt.NDArray[np.uint32]) -> list[str]:
        """Ids of an array of handles (diagnostics; ``KeyError`` for a stale handle)."""
    def handle_of(self, request_id: str) -> int | None:
        """The handle of a live (not finished) request id, else None."""
    def runs_after_in_flight(self) -> bool:
        """Whether scheduling another step now can give a request a token that is not
        dropped: a waiting request the pause state lets in (S13), or a running one that
        the tokens in flight do not take to ``max_tokens`` or ``max_model_len`` (S17).
        Async scheduling schedules a step ahead only then."""
    def num_prompt_tokens(self, handles: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
        """Prompt lengths of live handles (or finished ones not yet reported by
        ``schedule()``); ``KeyError`` for a stale handle."""
    def arrival_times(self, handles: npt.NDArray[np.uint32]) -> npt.NDArray[np.float64]:
        """The ``arrival_time`` given to ``add_request``, per handle (live, or finished and not
        yet reported by ``schedule()``); ``KeyError`` for a stale handle."""
    def request_info(self, handle: int) -> _RequestInfo:
        """A request's state as a dict (diagnostics); ``KeyError`` for a stale handle."""
    def token_ids(self, handle: int) -> npt.NDArray[np.uint32]:
        """Prompt and output tokens of a request."""
    def ignore_reason(self, handle: int) -> str | None:
        """Why a request was finished as ignored (names the sizes), else None."""
    def running_handles(self) -> list[int]:
        """Handles in RUNNING, in scan order."""
    def waiting_handles(self) -> list[int]:
        """Waiting handles in admission order: KV-holding queue first, then the waiting queue."""
    def set_pause_state(self, state: _PauseState) -> None:
        """S13: ``"paused_new"`` schedules running and KV-holding requests only (no
        admissions, no resumes; running ones may still be preempted), ``"paused_all"``
        schedules nothing; ``"unpaused"`` resumes. Nothing is lost. Takes effect at the
        next ``schedule()`` and changes ``has_requests()`` at once. ``ValueError`` for
        another string."""
    @property
    def pause_state(self) -> _PauseState:
        """The pause state in force (S13), as ``set_pause_state`` takes it."""
    def reset_prefix_cache(self) -> None:
        """S8: no block computed so far is a prefix-cache hit again (new weights make their KV
        stale). Requests keep their blocks and go on; their blocks are never shared."""
    def record_kv_events(self, on: bool) -> None:
        """Start (or stop) recording the block hashes that enter and leave the prefix cache
        (S8), for a frontend that routes by prefix (``--routing prefix``)."""
    def take_kv_events(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """The hashes cached and evicted since the last call: ``(stored, removed)``; a hash
        held by several blocks is reported once per block. Empty when not recording."""
    def add_stream_input(
        self, request_id: str, token_ids: _TokenIds, max_tokens: int, is_last: bool = False
    ) -> None:
        """S15: more input for a streaming session, generating up to ``max_tokens``
        more; queued if the session is still generating. ``is_last`` ends the
        session after that segment. ``KeyError`` for an unknown id, ``ValueError``
        for a request that is not an open session or ``max_tokens == 0``."""
    def close_stream(self, request_id: str) -> None:
        """Ends a streaming session: at once if it waits for input, otherwise when its
        current segment ends. ``KeyError`` for an unknown id."""
    def use_test_connector(self, num_external_tokens: int, ready_after_steps: int) -> None:
        """Installs the test KV connector (S7): every request has up to
        ``num_external_tokens`` tokens (whole blocks, never the last token) of
        remote KV, loaded asynchronously in ``ready_after_steps`` scheduler steps."""
    def use_engine_connector(self) -> None:
        """Installs the engine-driven KV connector (S7 ``remote_kv``): the engine says
        what its store holds (:meth:`set_external_tokens`), runs the loads the scheduler
        starts (:meth:`take_kv_loads`), reports them (:meth:`finish_kv_load`) and saves
        the blocks that become full (:meth:`take_cached_blocks`)."""
    def block_hashes(self, handle: int) -> npt.NDArray[np.uint64]:
        """Prefix-cache hashes of the full blocks of a request's tokens (chained;
        the first covers the LoRA adapter). ``KeyError`` for an unknown handle."""
    def set_external_tokens(self, handle: int, num_tokens: int) -> None:
        """The engine's store holds the KV of the first ``num_tokens`` prompt tokens
        of ``handle``: at admission, the whole blocks of that past the local prefix-cache
        hit (never the last token) are loaded asynchronously."""
    def take_kv_loads(self) -> list[tuple[int, int, npt.NDArray[np.uint32], npt.NDArray[np.uint64]]]:
        """Loads started since the last call, as ``(load_id, handle, block_ids,
        block_hashes)``: fill those blocks with the KV stored under those hashes."""
    def cached_block_contents(
        self, block_ids: npt.NDArray[np.uint32]
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint32]]:
        """What the cached blocks ``block_ids`` hold, for a KV connector to store beside
        their KV: each one's parent hash, and their token ids (``block_size`` per block,
        flat). ``ValueError`` for a block that is not cached."""
    def take_cached_blocks(self) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint64]]:
        """Blocks that became full and cached since the last call, and their hashes.
        Their KV is computed by the step scheduled last (or an earlier one)."""
    def finish_kv_load(self, handle: int, load_id: int, num_loaded_blocks: int) -> bool:
        """Ends a load whose first ``num_loaded_blocks`` blocks were filled (fewer than
        all: a failure; the rest is computed). False: the load is no longer live (its
        request was aborted), and its blocks must not be written."""
    def set_async_scheduling(self, on: bool) -> None:
        """With async scheduling the next step is scheduled before the previous
        step's tokens are known (a decode's next token is a placeholder)."""

@final
class SharedAdmissionStats:
    """A6: in-flight request counters shared by the gRPC frontend processes, so
    that ``max_num_queued_reqs`` (A2) is enforced globally: in-flight = the sum of
    every frontend's counter.

    A shared-memory file (``/dev/shm/<name>`` unless ``dir`` is given, mode 0600)
    holds a 64-byte header and one 64-byte (cache-line) slot per frontend. A
    frontend writes only its own slot's counter, with one atomic add and no lock;
    ``total()`` sums all slots. The launcher ``create``s the segment before forking
    the frontends and keeps the returned handle alive (dropping it unlinks the
    file); frontend ``i`` calls ``open(name, i)``.

    Every method is a few atomic operations (nanoseconds) and holds the GIL.
    Errors: ``ValueError`` for a bad name, ``num_slots`` or ``slot``;
    ``OSError`` for a segment that cannot be created, opened or written (and for
    ``add``/``set``/``own`` on the creator's handle, which has no slot). Linux only
    in practice (``/dev/shm`` and ``/proc``)."""

    @staticmethod
    def create(name: str, num_slots: int, dir: str | None = None) -> SharedAdmissionStats:
        """Creates segment ``name`` with ``num_slots`` zeroed slots (1 to 4096).
        ``name`` is 1 to 255 ASCII letters, digits, ``-``, ``_`` or ``.``, not only
        dots. The file is created exclusively; if it exists and its recorded
        creator process is dead (a crashed run) it is removed and recreated, if the
        creator is alive ``OSError`` names its PID. The returned handle has no
        slot (``slot is None``)."""
    @staticmethod
    def open(name: str, slot: int, dir: str | None = None) -> SharedAdmissionStats:
        """Attaches a frontend to ``slot`` after checking the segment's header
        (magic, layout version, size). Claims the slot: its counter is reset to 0,
        so a restarted frontend does not inherit a crashed predecessor's count.
        ``ValueError`` if ``slot >= num_slots``, ``OSError`` if the segment is
        missing or malformed."""
    def add(self, delta: int) -> None:
        """Adds ``delta`` to this frontend's counter (``+n`` on admission, ``-1``
        when a request finishes or is aborted). Sequentially consistent, so the
        pattern "add, then check ``total()``, add back on overflow" never admits
        past the limit even when frontends race."""
    def set(self, value: int) -> None:
        """Sets this frontend's counter, e.g. to its exact unfinished count."""
    def own(self) -> int:
        """This frontend's counter."""
    def total(self) -> int:
        """The sum of every frontend's counter: the global in-flight count (A2)."""
    def unlink(self) -> None:
        """Removes the segment's file (idempotent). Mapped handles keep working;
        later ``open`` calls fail. The creator calls this on shutdown; dropping the
        creator's handle does it too."""
    @property
    def num_slots(self) -> int:
        """Number of frontend slots in the segment."""
    @property
    def name(self) -> str:
        """The segment name given to ``create``/``open``."""
    @property
    def slot(self) -> int | None:
        """This frontend's slot, or None for the creator's handle."""
    @property
    def path(self) -> str:
        """The segment's file path."""

@final
class BlockHasher:
    """The scheduler's prefix-cache block hash (S8): a frontend that routes by prefix
    computes with it exactly the hashes an engine caches."""

    def __new__(cls, block_size: int, hash_algo: str = "builtin") -> BlockHasher: ...
    @property
    def block_size(self) -> int: ...
    def prompt_hashes(
        self, token_ids: list[int], lora_id: int | None = None, cache_salt: str | None = None
    ) -> npt.NDArray[np.uint64]:
        """The chained hashes of the full blocks of ``token_ids`` (a partial last block has
        none), from the root of adapter ``lora_id`` and ``cache_salt``."""

# Quantized CPU matmuls (rust/fastsched-kernels), called by fastsched.kernels.quant_matmul_cpu
# with raw tensor addresses that it has checked.
def set_kernel_threads(threads: int) -> None: ...
def kernel_threads() -> int: ...
def kernel_isa() -> str: ...

# Tensors cross as DLPack capsules (``torch.utils.dlpack.to_dlpack(t)``) or objects with
# ``__dlpack__``, on the CPU; the binding checks dtype, layout, alignment and aliasing (a
# written tensor shares memory with nothing else of the call), the kernels lengths and ranges:
# TypeError for a wrong dtype or object, ValueError for the rest.
@final
class QuantWeight:
    """An int4 / int8 weight ``[N, K]``'s buffers, checked against the shape and held."""

    def __new__(
        cls,
        bits: int,
        scale_group: int,
        n: int,
        k: int,
        data: object,
        scale: object,
        zero: object | None = None,
    ) -> QuantWeight:
        """int4: ``data`` packed ``[N, K/2]`` uint8, ``scale`` and ``zero`` ``[N, K/32]`` float32;
        int8: ``data`` codes ``[N, K]`` int8, ``scale`` ``[N, K/scale_group]``, ``zero`` optional."""
    @property
    def bits(self) -> int: ...
    @property
    def shape(self) -> tuple[int, int]: ...

def quant_matmul(w: QuantWeight, x: object, out: object) -> None:
    """``out [M, N]`` (float32) ``= x [M, K]`` (float32 or bfloat16) ``· Wᵀ``."""

def quant_dequantize_bf16(w: QuantWeight, out: object) -> None:
    """The weight as bfloat16 ``out [N, K]``."""

def quant_gemm_simd() -> bool:
    """Whether the many-row bf16 GEMM has its AVX-512 BF16 kernel on this CPU."""

def quant_gemm_bf16(w: QuantWeight, x: object, out: object) -> None:
    """``out[M, N]`` (float32) ``= x[M, K]`` (bfloat16) ``· Wᵀ`` by the many-row GEMM."""

# CPU attention and elementwise kernels (rust/fastsched-kernels), called by
# fastsched.kernels.cpu_ops; sizes come from the tensors' shapes.
def paged_attention(
    query: object,
    key: object,
    value: object,
    out: object,
    kv_cache: object,
    slot_mapping: object,
    query_start_loc: object,
    seq_lens: object,
    block_tables: object,
    reqs: object,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> None: ...
def add_rms_norm_bf16(
    hidden: object, delta: object | None, weight: object, out: object, eps: float
) -> None: ...
def rms_norm_heads_bf16(x: object, heads: int, weight: object, eps: float) -> None: ...
def rope(x: object, heads: int, head_dim: int, positions: object, cos: object, sin: object) -> None: ...
def silu_mul_bf16(gate_up: object, out: object) -> None: ...
def gelu_tanh_mul_bf16(gate_up: object, out: object) -> None: ...

# The decoder stack in one call (rust/fastsched-kernels' decoder), built and called by
# fastsched.models.llama_cpu; it holds its weights' tensors.
@final
class CpuDecoder:
    """The decoder layers of a Llama-family model with int4/int8 linears, run as one call a step."""

    def __new__(
        cls,
        sizes: Sequence[int],
        eps: float,
        dense_min_rows: int,
        norms: Sequence[Sequence[object | None]],
        weights: Sequence[Sequence[QuantWeight]],
        biases: Sequence[Sequence[object | None]],
        final_norm: object,
        options: Sequence[tuple[str, int | None, int, float | None, float]],
    ) -> CpuDecoder:
        """``norms``: per layer input, post, q, k, attn_out, mlp_out (None: none); ``options``: per
        layer activation, sliding window, RoPE table, logit soft-cap, attention scale."""
    def forward(
        self,
        hidden: object,
        out: object,
        positions: object,
        tables: Sequence[tuple[object, object]],
        caches: Sequence[object],
        slot_mapping: object,
        query_start_loc: object,
        seq_lens: object,
        block_tables: object,
        reqs: object,
        num_rows: int,
    ) -> None:
        """Every layer and the final norm on the bfloat16 residual stream ``hidden`` (updated
        in place), the final-normed rows into ``out``."""
    @property
    def num_layers(self) -> int: ...
