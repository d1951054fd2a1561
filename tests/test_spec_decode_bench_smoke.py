"""bench/spec_decode_bench.py runs end to end on the tiny model, checks that every
configuration produced the greedy tokens of the one without drafts, and prints its rows.

A smoke test only: the figures depend on the machine, so nothing here asserts on time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_prints_one_row_per_configuration_with_the_same_tokens() -> None:
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "spec_decode_bench.py"),
        "--model",
        "tiny",
        "--num-requests",
        "2",
        "--max-tokens",
        "12",
        "--repeat",
        "1",
        "--k",
        "2",
    ]
    env = {
        "PYTHONPATH": str(ROOT / "python"),
        "HF_HUB_OFFLINE": "1",
        "TQDM_DISABLE": "1",
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    assert [r["spec"] for r in rows] == ["none (async)", "none (sync)", "ngram", "draft_model"]
    assert {r["tokens"] for r in rows} == {24}
    draft = rows[-1]  # the tiny model drafting for itself: every draft is accepted
    assert draft["acceptance_rate"] == 1.0 and draft["mean_acceptance_length"] == 3.0
