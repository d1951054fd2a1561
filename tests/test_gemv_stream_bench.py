"""bench/gemv_stream.py runs end to end and reports both weight groups (a smoke test: no time
is asserted on)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fastsched.kernels import quant_matmul_cpu

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gemv_stream.py"


@pytest.mark.skipif(not quant_matmul_cpu.AVAILABLE, reason="needs the Rust kernels")
def test_gemv_stream_reports_the_layers_and_the_lm_head():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--threads", "1", "--passes", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["120 layer weights (int4)", "lm_head (int8, tied)"]
    assert all("GB/s (1 threads)" in line for line in lines)
