"""How fast an engine drains its prefill backlog, for the TTFT-SLO admission valve.

``--ttft-slo`` sets ``max_num_queued_tokens = TTFT target × prefill throughput``: a
prompt token admitted behind Q queued ones waits about Q / T_p before its prefill ends.
The throughput that matters is the rate at which queued prompt tokens actually leave
the queue under load, so the meter counts only *backlogged* steps — steps after which
prompt tokens were still left: a request still waiting, or a prompt only partly
computed (chunked prefill). Steps with no prompt left over measure demand, not capacity:
counting them would make a lightly loaded engine look slow and close the valve on the
next burst. Decode work and slots that free up slowly are in the measurement on
purpose: they are what slows the drain.

The window is busy time, not wall time: an idle engine keeps its last measurement,
because being idle says nothing about its speed.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from numpy.typing import ArrayLike

DEFAULT_WINDOW_S = 5.0  # backlogged step time the estimate is taken over
MIN_DATA_S = 0.2  # backlogged step time before an estimate is given at all
MIN_DATA_STEPS = 4


class PrefillThroughputMeter:
    """Prompt tokens prefilled per second of backlogged step time, over a sliding window."""

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        min_data_s: float = MIN_DATA_S,
        min_data_steps: int = MIN_DATA_STEPS,
    ) -> None:
        if window_s <= 0 or min_data_s < 0 or min_data_s > window_s:
            raise ValueError(
                f"need 0 <= min_data_s <= window_s and window_s > 0, got {min_data_s}, {window_s}"
            )
        self.window_s = window_s
        self.min_data_s = min_data_s
        self.min_data_steps = min_data_steps
        self._steps: deque[tuple[int, float]] = deque()
        self._tokens = 0
        self._duration = 0.0

    def observe(self, prefill_tokens: int, duration_s: float, backlogged: bool) -> None:
        """One engine step: the prompt tokens it computed, how long it took, and whether
        prompt tokens were left over after it (see the module docstring)."""
        if not backlogged or duration_s <= 0:
            return
        self._steps.append((prefill_tokens, duration_s))
        self._tokens += prefill_tokens
        self._duration += duration_s
        while self._duration - self._steps[0][1] >= self.window_s:
            tokens, duration = self._steps.popleft()
            self._tokens -= tokens
            self._duration -= duration

    @property
    def tokens_per_s(self) -> float | None:
        """The estimate, or None until the window holds enough backlogged steps."""
        if len(self._steps) < self.min_data_steps or self._duration < self.min_data_s:
            return None
        return self._tokens / self._duration


def prefill_tokens(
    num_scheduled: ArrayLike, num_computed: ArrayLike, prompt_lens: ArrayLike
) -> tuple[int, bool]:
    """Prompt tokens among a step's scheduled tokens (recomputed outputs of a preempted
    request are not prompt: they never were in the admission backlog), and whether a
    scheduled prompt is left unfinished (a chunked prefill: backlog the step could not take).
    Vectorised: it runs on every engine step, over every scheduled row."""
    computed = np.asarray(num_computed, dtype=np.int64)
    left = np.asarray(prompt_lens, dtype=np.int64) - computed  # prompt tokens not computed before the step
    if not np.count_nonzero(left > 0):
        return 0, False  # decodes only: the common step
    scheduled = np.asarray(num_scheduled, dtype=np.int64)
    tokens = int(np.minimum(np.maximum(left, 0), scheduled).sum())
    return tokens, bool((scheduled < left).any())
