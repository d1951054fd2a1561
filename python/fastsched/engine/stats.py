"""Engine statistics: counters for metrics and a periodic log line (docs/design.md §7)."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastsched.engine.protocol import ITERATION_TOKENS_BUCKETS
from fastsched.spec_decode.metrics import SpecDecodingCounters

logger = logging.getLogger("fastsched.engine")


@dataclass
class StatsLogger:
    """Accumulates throughput counters and logs them every ``interval`` seconds under load."""

    interval: float
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    _last_log: float = field(default_factory=time.monotonic)
    _prompt_since: int = 0
    _generation_since: int = 0
    _prefix_queries: int = 0
    _prefix_hits: int = 0
    # Tokens per step (vllm:iteration_tokens_total): counts per bucket of ITERATION_TOKENS_BUCKETS.
    iteration_tokens: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    iteration_tokens_sum: int = 0
    spec: SpecDecodingCounters | None = None  # speculative decoding's counters, when it is on
    _spec_drafts: int = 0  # their values at the last log line
    _spec_draft_tokens: int = 0
    _spec_accepted: int = 0

    def on_iteration(self, num_scheduled_tokens: int) -> None:
        """One engine step that scheduled ``num_scheduled_tokens`` (prompt and decode tokens)."""
        self.iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_scheduled_tokens)] += 1
        self.iteration_tokens_sum += num_scheduled_tokens

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens_total += num_prompt_tokens
        self._prompt_since += num_prompt_tokens

    def on_step(self, generated: int, scheduler_stats: Callable[[], dict]) -> None:
        """Counts the step's ``generated`` tokens; reads the scheduler's stats only when a log line is due."""
        self.generation_tokens_total += generated
        self._generation_since += generated
        if self.interval <= 0:
            return
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval:
            return
        sched_stats = scheduler_stats()
        queries = sched_stats["prefix_cache_queries"] - self._prefix_queries
        hits = sched_stats["prefix_cache_hits"] - self._prefix_hits
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d reqs, "
            "waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
            self._prompt_since / elapsed,
            self._generation_since / elapsed,
            sched_stats["num_running"],
            sched_stats["num_waiting"],
            100 * sched_stats["kv_cache_usage"],
            100 * hits / queries if queries else 0.0,
        )
        if self.spec is not None:
            self._log_spec(self.spec)
        self._last_log = now
        self._prompt_since = self._generation_since = 0
        self._prefix_queries = sched_stats["prefix_cache_queries"]
        self._prefix_hits = sched_stats["prefix_cache_hits"]

    def _log_spec(self, spec: SpecDecodingCounters) -> None:
        """Speculative decoding since the last line, as vLLM's SpecDecoding metrics line (none
        when nothing was drafted since)."""
        drafts = spec.num_drafts - self._spec_drafts
        if not drafts:
            return
        draft_tokens = spec.num_draft_tokens - self._spec_draft_tokens
        accepted = spec.num_accepted_tokens - self._spec_accepted
        logger.info(
            "speculative decoding: draft acceptance rate: %.1f%%, mean acceptance length: %.2f, "
            "accepted: %d tokens, drafted: %d tokens",
            100 * accepted / draft_tokens,
            1 + accepted / drafts,
            accepted,
            draft_tokens,
        )
        self._spec_drafts, self._spec_draft_tokens = spec.num_drafts, spec.num_draft_tokens
        self._spec_accepted = spec.num_accepted_tokens
