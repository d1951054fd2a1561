"""bench/protocol_codec.py runs end to end on this tree (a smoke test: nothing here reads a time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "protocol_codec.py"


def test_protocol_bench_prints_a_line_per_hot_message() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--rows", "4", "--prompt-len", "4", "--repeat", "5", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["add", "outputs"]
    assert all("encode" in line and "decode" in line and line.endswith("bytes") for line in lines)
