"""bench/scheduler_bench.py runs end to end and ends with its JSON summary.

A smoke test only: the figures depend on the machine, so nothing here
asserts on time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "scheduler_bench.py"
TINY = [
    "--running", "8", "--waiting", "4", "--steps", "50", "--warmup", "5",
    "--prompt-len", "32", "--output-len", "8",
]  # fmt: skip
REQUIRED_KEYS = {
    "median_us",
    "p99_us",
    "steps_per_s",
    "mean_scheduled_reqs",
    "mean_scheduled_tokens",
    "preemptions",
}


def run_bench(*extra: str) -> tuple[str, dict]:
    proc = subprocess.run(
        [sys.executable, str(BENCH), *TINY, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    return proc.stdout, json.loads(lines[-1])


def test_last_line_is_json_summary_with_sane_values():
    stdout, summary = run_bench()
    assert REQUIRED_KEYS <= summary.keys()
    assert "median" in stdout and "config" in stdout, "readable table before the JSON"
    assert summary["steps_per_s"] > 0
    assert 0 < summary["mean_scheduled_reqs"] <= 8, "never more than --running per step"
    assert summary["mean_scheduled_tokens"] >= summary["mean_scheduled_reqs"]
    assert summary["median_us"] > 0
    assert summary["p99_us"] >= summary["median_us"]
    assert summary["preemptions"] == 0, "ample blocks by default"


@pytest.mark.parametrize("extra", [["--policy", "priority"], ["--no-prefix-caching"]])
def test_other_policies_and_no_prefix_caching_run(extra):
    _, summary = run_bench(*extra)
    assert summary["mean_scheduled_reqs"] > 0


def test_scarce_blocks_preempt():
    # 8 running need up to 8 * 4 blocks of 16 tokens; 14 cannot hold them.
    _, summary = run_bench("--num-blocks", "14")
    assert summary["preemptions"] > 0
    assert summary["mean_scheduled_reqs"] > 0


def test_batched_tokens_below_running_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, str(BENCH), *TINY, "--max-num-batched-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "--max-num-batched-tokens (4) must be at least max_num_seqs (8)" in proc.stderr
