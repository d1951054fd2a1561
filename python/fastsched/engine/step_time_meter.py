"""How long an engine step takes for the tokens it carries, for the goodput valve (``--tpot-slo``).

A step's time grows with the tokens it schedules: decodes of the running requests plus
chunks of prompt. The valve predicts both a newcomer's TTFT and the TPOT the running
requests will see from that relation, so the engine fits it on its own steps,
``duration ≈ base_s + per_token_s × scheduled tokens``, by least squares over the most
recent steps. Unlike the prefill meter, every step counts: a light step says how fast
decodes are, a full one how much a prompt chunk costs, and the fit needs both.

The window is a number of steps, not seconds, so an idle engine keeps its last fit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW_STEPS = 512
MIN_DATA_STEPS = 8  # steps before a fit is given at all


@dataclass(frozen=True)
class StepTimeFit:
    """``step time(tokens) = base_s + per_token_s × tokens``: seconds, both >= 0."""

    base_s: float
    per_token_s: float

    def __post_init__(self) -> None:
        if not (self.base_s >= 0 and self.per_token_s >= 0):
            raise ValueError(
                f"a step-time fit needs base_s >= 0 and per_token_s >= 0, "
                f"got {self.base_s!r}, {self.per_token_s!r}"
            )

    def step_time(self, num_tokens: float) -> float:
        """Seconds for a step that schedules ``num_tokens`` tokens."""
        return self.base_s + self.per_token_s * num_tokens


class StepTimeMeter:
    """Least-squares fit of step duration on scheduled tokens over the last steps."""

    def __init__(
        self, window_steps: int = DEFAULT_WINDOW_STEPS, min_data_steps: int = MIN_DATA_STEPS
    ) -> None:
        if window_steps < 2 or not 2 <= min_data_steps <= window_steps:
            raise ValueError(
                f"need 2 <= min_data_steps <= window_steps, got {min_data_steps}, {window_steps}"
            )
        self.min_data_steps = min_data_steps
        self._steps: deque[tuple[int, float]] = deque(maxlen=window_steps)

    def observe(self, num_tokens: int, duration_s: float) -> None:
        """One engine step: the tokens it scheduled (prompt and decode) and how long it took."""
        if num_tokens > 0 and duration_s > 0:
            self._steps.append((num_tokens, duration_s))

    @property
    def fit(self) -> StepTimeFit | None:
        """The fit, or None until the window holds ``min_data_steps`` steps. Steps all of
        one size give no slope: their mean time is spread over their tokens. A negative
        intercept or slope (noise) is clipped to 0, the other refitted through the means."""
        n = len(self._steps)
        if n < self.min_data_steps:
            return None
        mean_x = sum(x for x, _ in self._steps) / n
        mean_y = sum(y for _, y in self._steps) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._steps)
        if var_x <= 0:
            return StepTimeFit(0.0, mean_y / mean_x)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self._steps) / var_x
        if slope <= 0:
            return StepTimeFit(mean_y, 0.0)
        base = mean_y - slope * mean_x
        if base < 0:
            return StepTimeFit(0.0, mean_y / mean_x)
        return StepTimeFit(base, slope)
