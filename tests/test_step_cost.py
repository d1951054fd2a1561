"""The step-cost model of ``fastsched simulate`` and ``fastsched bench fit-step-cost`` as
specifications: the fit recovers known coefficients, never goes negative, and a bad
trace line is named. Nothing here runs a model or asserts on time."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fastsched.entrypoints.cli import main
from fastsched.tools.simulator.cost import StepCost, fit_step_cost, read_step_trace

A, B, C = 0.002, 20e-6, 150e-6  # 2 ms per step, 20 us per token, 150 us per request


def synthetic_steps(n: int = 400, noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """Steps of random shapes timed by t = A + B·tokens + C·rows (+ Gaussian noise)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(1, 64, n)
    tokens = rows + rng.integers(0, 2048, n) * (rng.random(n) < 0.3)
    duration = A + B * tokens + C * rows + rng.normal(0.0, noise, n)
    return np.column_stack([tokens, rows, duration]).astype(float)


def write_trace(path: Path, steps: np.ndarray) -> Path:
    with path.open("w") as f:
        for tokens, rows, duration in steps:
            line = {
                "time": 0.0,
                "batched_tokens": int(tokens),
                "running_reqs": int(rows),
                "prefill_tokens": 0,
                "prefill_reqs": 0,
                "duration_s": float(duration),
            }
            f.write(json.dumps(line) + "\n")
    return path


def test_fit_recovers_the_coefficients_of_an_exact_trace() -> None:
    fit = fit_step_cost(synthetic_steps())
    assert fit.cost.a == pytest.approx(A)
    assert fit.cost.b == pytest.approx(B)
    assert fit.cost.c == pytest.approx(C)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.num_steps == 400
    assert fit.residual_std_s == pytest.approx(0.0, abs=1e-12)


def test_fit_recovers_the_coefficients_through_noise() -> None:
    fit = fit_step_cost(synthetic_steps(n=5000, noise=0.0005))
    assert fit.cost.a == pytest.approx(A, rel=0.05)
    assert fit.cost.b == pytest.approx(B, rel=0.05)
    assert fit.cost.c == pytest.approx(C, rel=0.05)
    assert 0.9 < fit.r2 < 1.0
    assert fit.residual_std_s == pytest.approx(0.0005, rel=0.1)
    assert fit.residual_p10_s < 0 < fit.residual_p90_s


def test_fit_never_returns_a_negative_coefficient() -> None:
    # Steps that get cheaper with more rows: least squares would give c < 0; the fit holds it at 0.
    steps = np.array([[10, 1, 0.010], [10, 5, 0.009], [100, 1, 0.020], [100, 5, 0.019], [50, 3, 0.0145]])
    fit = fit_step_cost(steps)
    assert fit.cost.c == 0.0
    assert fit.cost.a > 0 and fit.cost.b > 0
    unconstrained = np.linalg.lstsq(np.column_stack([np.ones(5), steps[:, :2]]), steps[:, 2], rcond=None)[0]
    assert unconstrained[2] < 0


def test_fit_needs_three_steps() -> None:
    with pytest.raises(ValueError, match="at least 3 steps"):
        fit_step_cost(synthetic_steps(n=2))


def test_read_step_trace_concatenates_files(tmp_path: Path) -> None:
    first = write_trace(tmp_path / "a.jsonl", synthetic_steps(n=5, seed=1))
    second = write_trace(tmp_path / "b.jsonl", synthetic_steps(n=7, seed=2))
    assert read_step_trace([first, second]).shape == (12, 3)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"batched_tokens": 4, "running_reqs": 2}', "field 'duration_s'"),
        ('{"batched_tokens": "4", "running_reqs": 2, "duration_s": 0.1}', "field 'batched_tokens'"),
        ('{"batched_tokens": 4, "running_reqs": -1, "duration_s": 0.1}', "field 'running_reqs'"),
        ("not json", "not JSON"),
    ],
)
def test_a_bad_step_trace_line_is_named_with_its_field(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text('{"batched_tokens": 4, "running_reqs": 2, "duration_s": 0.1}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"steps.jsonl:2: .*{message}"):
        read_step_trace([path])


def test_step_cost_is_affine_and_rejects_negative_or_all_zero_coefficients() -> None:
    assert StepCost(A, B, C).step_time(100, 4) == pytest.approx(A + 100 * B + 4 * C)
    with pytest.raises(ValueError, match="coefficient b"):
        StepCost(A, -B, C)
    with pytest.raises(ValueError, match="all zeros"):
        StepCost(0, 0, 0)


def test_step_cost_load_names_a_missing_coefficient(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text('{"a": 0.001, "c": 0.0001}')
    with pytest.raises(ValueError, match="missing b"):
        StepCost.load(path)


def test_fit_step_cost_command_prints_and_writes_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    trace = write_trace(tmp_path / "steps.jsonl", synthetic_steps())
    out = tmp_path / "cost.json"
    assert main(["bench", "fit-step-cost", str(trace), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "R^2 = 1.0000" in printed and "steps: 400" in printed
    model = json.loads(out.read_text())
    assert (
        model["a"] == pytest.approx(A) and model["b"] == pytest.approx(B) and model["c"] == pytest.approx(C)
    )
    assert model["num_steps"] == 400 and model["r2"] == pytest.approx(1.0)
    assert model["source"] == str(trace)
    assert StepCost.load(out) == StepCost(model["a"], model["b"], model["c"])
