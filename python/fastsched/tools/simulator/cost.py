"""The step-cost model ``t_step = a + b·batched_tokens + c·running_reqs`` and its fit.

A step's time on a given model, device and config is close to affine in the tokens it
computes (the weight matmuls) and the rows it holds (per-row sampling, attention
set-up, output handling). Three numbers are enough for the simulator to rank configs,
and few enough to fit from any real run's step trace (``--step-trace``).

The fit is non-negative least squares: a negative coefficient would make a bigger
batch cheaper, which no engine does, and would let the simulator produce negative
step times. With three unknowns the exact solution is found by trying every subset
of coefficients left free (the others held at 0) and keeping the best one whose
coefficients are all non-negative.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastsched.tools.simulator.jsonl import read_objects

STEP_TRACE_FIELDS = ("batched_tokens", "running_reqs", "duration_s")


@dataclass(frozen=True)
class StepCost:
    """Seconds per step: ``a`` fixed, ``b`` per scheduled token, ``c`` per row."""

    a: float
    b: float
    c: float

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise ValueError(f"step cost coefficient {name} must be a finite number >= 0, got {value!r}")
        if self.a == self.b == self.c == 0:
            raise ValueError("the step cost model is all zeros: every step would take no time")

    def step_time(self, batched_tokens: int, running_reqs: int) -> float:
        return self.a + self.b * batched_tokens + self.c * running_reqs

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> StepCost:
        """From the JSON ``fastsched bench fit-step-cost`` writes (``a``, ``b``, ``c``; other keys ignored)."""
        data = json.loads(Path(path).read_text())
        missing = [k for k in ("a", "b", "c") if not isinstance(data, dict) or k not in data]
        if missing:
            raise ValueError(f"{path}: the cost model is missing {', '.join(missing)}")
        return cls(float(data["a"]), float(data["b"]), float(data["c"]))


@dataclass(frozen=True)
class StepCostFit:
    """A fitted :class:`StepCost` and how well it explains the steps it was fitted on."""

    cost: StepCost
    r2: float
    num_steps: int
    residual_std_s: float
    residual_p10_s: float
    residual_p90_s: float
    mean_duration_s: float
    source: str

    def to_json(self) -> dict[str, object]:
        return {**asdict(self.cost), **{k: v for k, v in asdict(self).items() if k != "cost"}}


def read_step_trace(paths: Sequence[str | os.PathLike[str]]) -> np.ndarray:
    """The steps of one or more ``--step-trace`` files as an ``(n, 3)`` array of
    (batched_tokens, running_reqs, duration_s). A bad line is an error naming file and line."""
    rows: list[tuple[float, float, float]] = []
    for path in paths:
        rows.extend(_parse_step(record, where) for record, where in read_objects(path))
    return np.array(rows, dtype=float).reshape(-1, 3)


def _parse_step(record: dict[str, Any], where: str) -> tuple[float, float, float]:
    values = []
    for name in STEP_TRACE_FIELDS:
        value = record.get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not np.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"{where}: field {name!r} must be a number >= 0, got {value!r}")
        values.append(float(value))
    return values[0], values[1], values[2]


def fit_step_cost(steps: np.ndarray, source: str = "") -> StepCostFit:
    """Non-negative least squares of duration on [1, batched_tokens, running_reqs]."""
    if len(steps) < 3:
        raise ValueError(f"fitting three coefficients needs at least 3 steps, got {len(steps)}")
    x = np.column_stack([np.ones(len(steps)), steps[:, 0], steps[:, 1]])
    y = steps[:, 2]
    coef = _nnls(x, y)
    residuals = y - x @ coef
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((residuals**2).sum()) / total if total > 0 else 1.0
    return StepCostFit(
        cost=StepCost(*(float(v) for v in coef)),
        r2=r2,
        num_steps=len(steps),
        residual_std_s=float(residuals.std()),
        residual_p10_s=float(np.percentile(residuals, 10)),
        residual_p90_s=float(np.percentile(residuals, 90)),
        mean_duration_s=float(y.mean()),
        source=source,
    )


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    best, best_sse = np.zeros(x.shape[1]), float((y**2).sum())
    for free in _subsets(range(x.shape[1])):
        coef = np.zeros(x.shape[1])
        coef[list(free)] = np.linalg.lstsq(x[:, list(free)], y, rcond=None)[0]
        sse = float(((y - x @ coef) ** 2).sum())
        if (coef >= 0).all() and sse < best_sse:
            best, best_sse = coef, sse
    return best


def _subsets(items: Iterable[int]) -> Iterable[tuple[int, ...]]:
    pool = tuple(items)
    return itertools.chain.from_iterable(itertools.combinations(pool, k) for k in range(1, len(pool) + 1))


def format_fit(fit: StepCostFit) -> str:
    """Human-readable: the coefficients in the units one reasons in, and the fit's quality."""
    c = fit.cost
    return "\n".join(
        [
            f"steps: {fit.num_steps} (mean {fit.mean_duration_s * 1e3:.3f} ms)",
            f"a = {c.a * 1e3:.4f} ms per step",
            f"b = {c.b * 1e6:.4f} us per batched token",
            f"c = {c.c * 1e6:.4f} us per running request",
            f"R^2 = {fit.r2:.4f}; residuals: std {fit.residual_std_s * 1e3:.4f} ms, "
            f"p10 {fit.residual_p10_s * 1e3:+.4f} ms, p90 {fit.residual_p90_s * 1e3:+.4f} ms",
        ]
    )
