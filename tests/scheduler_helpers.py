"""Factories, a deterministic fake model and a step driver for tests of the
scheduler through the binding (``fastsched._core``).

Tests read as specifications: ``make_scheduler(block_size=4, num_gpu_blocks=8)``
builds a small scheduler in one line, ``drive(sched)`` runs it the way the
engine does (schedule, feed one sampled token to every request whose prefill
completed, update) and records what was decided, step by step, by request id.
Every step also checks the S16 invariants that hold for any trace.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastsched import Scheduler, SchedulerConfig

# Small defaults so a few requests exercise blocks, budgets and slots.
DEFAULTS: dict[str, Any] = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=4,
    num_gpu_blocks=257,  # 256 usable blocks: ample for every test that does not shrink it
)

KIND_CACHED, KIND_NEW, KIND_RESUMED = 0, 1, 2
RUNNING, STOP, LENGTH, ABORT, IGNORED = 0, 1, 2, 3, 4

# Fake-model tokens are >= FIRST_TOKEN, so EOS / stop ids below it never come by accident.
FIRST_TOKEN = 10
VOCAB_SIZE = 1000

TokenFn = Callable[[str, int], int]


def make_scheduler(**overrides: Any) -> Scheduler:
    """A scheduler with :data:`DEFAULTS`, any config field overridden."""
    return Scheduler(SchedulerConfig(**{**DEFAULTS, **overrides}))


def prompt(n: int, start: int = 100) -> list[int]:
    """``n`` distinct prompt tokens ``start, start+1, ...``."""
    return list(range(start, start + n))


def fake_token(request_id: str, index: int) -> int:
    """The fake model: output ``index`` (0-based) of ``request_id``, a pure function,
    so a preempted-and-resumed request must end with the same tokens as an
    undisturbed one."""
    return FIRST_TOKEN + zlib.crc32(f"{request_id}:{index}".encode()) % (VOCAB_SIZE - FIRST_TOKEN)


def emitting(at: dict[str, tuple[int, int]], base: TokenFn = fake_token) -> TokenFn:
    """A fake model that emits ``token`` as output ``index`` of request ``rid`` for
    each ``rid: (index, token)`` in ``at`` (an EOS or a stop token), else ``base``."""

    def token_fn(request_id: str, index: int) -> int:
        if request_id in at and at[request_id][0] == index:
            return at[request_id][1]
        return base(request_id, index)

    return token_fn


@dataclass
class Step:
    """What one ``schedule()`` + ``update_from_tokens()`` decided, by request id."""

    step_id: int
    scheduled: dict[str, int]
    kinds: dict[str, int]
    num_computed: dict[str, int]
    num_cached: dict[str, int]
    preempted: list[str]
    finished: list[str]  # reported by this schedule(): ended since the previous one
    total: int
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)  # non-zero codes only
    segment_ended: list[str] = field(default_factory=list)
    cached_reported: dict[str, int] = field(default_factory=dict)  # EngineCoreOutputs.num_cached_tokens
    num_free_blocks: int = 0

    def admitted(self) -> list[str]:
        """Ids scheduled as new or resumed this step."""
        return [rid for rid, k in self.kinds.items() if k in (KIND_NEW, KIND_RESUMED)]


@dataclass
class Run:
    steps: list[Step] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def preempted(self) -> list[str]:
        return [rid for s in self.steps for rid in s.preempted]

    def first(self, pred: Callable[[Step], object]) -> int:
        """Index of the first recorded step for which ``pred`` is truthy."""
        return next(i for i, s in enumerate(self.steps) if pred(s))


def check_step_invariants(sched: Scheduler, out: Any) -> None:
    """S16 invariants that hold after any ``schedule()``."""
    cfg = sched.config
    n = out.num_reqs
    counts = [int(x) for x in out.num_scheduled_tokens]
    assert len(out.req_handles) == len(counts) == len(out.kinds) == len(out.num_computed_tokens) == n
    assert all(c > 0 for c in counts), f"S16: every scheduled count > 0, got {counts}"
    assert sum(counts) == out.total_num_scheduled_tokens
    assert out.total_num_scheduled_tokens <= cfg.max_num_scheduled_tokens
    assert n <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
    assert len(set(int(h) for h in out.req_handles)) == n, "a request is scheduled at most once"
    offsets = [int(x) for x in out.block_offsets]
    assert len(offsets) == n + 1 and offsets[0] == 0 and offsets[-1] == len(out.block_ids)
    assert all(a <= b for a, b in zip(offsets, offsets[1:]))
    assert 0 <= sched.num_free_blocks <= cfg.num_gpu_blocks - 1


def step(sched: Scheduler, run: Run | None = None, token_fn: TokenFn = fake_token) -> Step:
    """One engine step: ``schedule()``, then one token from ``token_fn`` for each
    scheduled request whose prefill is complete (``num_computed >= num_tokens``
    after the step), then ``update_from_tokens``. Recorded into ``run``."""
    run = run if run is not None else Run()
    out = sched.schedule()
    check_step_invariants(sched, out)
    ids = sched.request_ids(out.req_handles)
    rec = Step(
        step_id=out.step_id,
        scheduled={rid: int(n) for rid, n in zip(ids, out.num_scheduled_tokens)},
        kinds={rid: int(k) for rid, k in zip(ids, out.kinds)},
        num_computed={rid: int(c) for rid, c in zip(ids, out.num_computed_tokens)},
        num_cached={
            rid: int(c) for rid, c, k in zip(ids, out.num_cached_tokens, out.kinds) if k != KIND_CACHED
        },
        preempted=sched.request_ids(out.preempted),
        finished=sched.request_ids(out.finished),
        total=out.total_num_scheduled_tokens,
    )
    tokens = np.full(len(ids), -1, dtype=np.int64)
    for i, (rid, handle) in enumerate(zip(ids, out.req_handles)):
        info = sched.request_info(int(handle))
        if info["num_computed_tokens"] >= info["num_tokens"]:
            tokens[i] = token_fn(rid, len(run.outputs[rid]))
    res = sched.update_from_tokens(tokens)
    for i, rid in enumerate(sched.request_ids(res.handles)):
        new = [int(t) for t in res.token_ids[res.token_offsets[i] : res.token_offsets[i + 1]]]
        rec.new_tokens[rid] = new
        run.outputs[rid].extend(new)
        if int(res.num_cached_tokens[i]) >= 0:
            rec.cached_reported[rid] = int(res.num_cached_tokens[i])
        if res.finish_reasons[i]:
            rec.finish_reasons[rid] = int(res.finish_reasons[i])
            run.finish_reasons[rid] = int(res.finish_reasons[i])
        if res.segment_ended[i]:
            rec.segment_ended.append(rid)
    rec.num_free_blocks = sched.num_free_blocks
    run.steps.append(rec)
    return rec


def drive(
    sched: Scheduler, token_fn: TokenFn = fake_token, max_steps: int = 500, run: Run | None = None
) -> Run:
    """Steps like ``EngineCore``: while ``has_requests()``, at most ``max_steps`` steps.
    Tests that expect every request to end assert ``not sched.has_requests()``."""
    run = run if run is not None else Run()
    for _ in range(max_steps):
        if not sched.has_requests():
            break
        step(sched, run, token_fn)
    return run


def add(
    sched: Scheduler, request_id: str, num_prompt_tokens: int = 8, max_tokens: int = 4, **kwargs: Any
) -> int:
    """Adds a request with a ``prompt(num_prompt_tokens)`` unless ``prompt_token_ids`` is given."""
    tokens = kwargs.pop("prompt_token_ids") if "prompt_token_ids" in kwargs else prompt(num_prompt_tokens)
    return sched.add_request(request_id, tokens, max_tokens, **kwargs)
