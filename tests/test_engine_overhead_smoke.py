"""bench/engine_overhead.py runs end to end, in every sampling mode and both loops, and
ends with its JSON summary.

A smoke test only: the figures depend on the machine, so nothing here asserts on time.
"""

from __future__ import annotations

import importlib.util
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "engine_overhead.py"
TINY = [
    "--running",
    "6",
    "--prompt-len",
    "20",
    "--steps",
    "6",
    "--warmup",
    "2",
    "--max-num-batched-tokens",
    "64",
]
REQUIRED_KEYS = {
    "host_us_median", "host_us_p99", "step_us_median", "steps_per_s", "tokens_per_s",
    "schedule_us", "prepare_inputs_us", "sample_us", "update_us", "collect_us", "output_us",
}  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("engine_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(bench, *extra: str) -> tuple[str, dict]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert bench.main([*TINY, *extra]) == 0
    lines = out.getvalue().strip().splitlines()
    return out.getvalue(), json.loads(lines[-1])


@pytest.mark.parametrize("sampling", ["greedy", "random", "penalties", "logprobs", "structured"])
@pytest.mark.parametrize("loop", ["--async-scheduling", "--no-async-scheduling"])
def test_last_line_is_json_summary_with_sane_values(bench, sampling: str, loop: str) -> None:
    stdout, summary = run(bench, "--sampling", sampling, loop, "--no-real-model", "--fake-forward-ms", "1")
    assert REQUIRED_KEYS <= summary.keys()
    assert summary["sampling"] == sampling and summary["running"] == 6
    assert summary["step_us_median"] > 0 and summary["tokens_per_s"] > 0
    assert "| null model, forward 1 ms |" in stdout


def test_real_model_and_llm_generate_rows(bench) -> None:
    stdout, summary = run(bench, "--llm-generate")
    assert "| real tiny model |" in stdout
    assert summary["real_model"]["forward_us_median"] > 0
    assert summary["llm_generate_tokens_per_s"] > 0
