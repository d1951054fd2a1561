"""Conformance with vLLM 0.33's V1 scheduler: every trace of the suite, replayed
through ``fastsched._core`` by ``replay.py``, must give the same decisions as
vLLM's own replay, step for step, ``kv_free_blocks`` included.

The suite (traces, vLLM's decisions, ``compare.py``, README) is the project's
spec material, vendored byte-identical under ``vllm/`` so a clean clone tests
without the shared folder; where the shared folder exists, a test checks the
copy has not drifted from it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from replay import replay

HERE = Path(__file__).resolve().parent
SUITE = HERE / "vllm"
TRACES = SUITE / "traces"
COMPARE = SUITE / "compare.py"
SHARED = HERE.parents[1] / ".." / "shared" / "conformance"  # <repo>/../shared/conformance

TRACE_NAMES = sorted(p.name.removesuffix(".trace.json") for p in TRACES.glob("*.trace.json"))


def test_vendored_suite_has_a_reference_for_every_trace():
    assert len(TRACE_NAMES) >= 10, f"expected the suite's traces under {TRACES}"
    missing = [name for name in TRACE_NAMES if not (TRACES / f"{name}.vllm.jsonl").is_file()]
    assert not missing, f"traces without vLLM decisions: {missing}"
    assert COMPARE.is_file() and (SUITE / "README.md").is_file()


@pytest.mark.parametrize("name", TRACE_NAMES)
def test_replay_matches_vllm_decisions_at_every_step(name: str, tmp_path: Path):
    ours = tmp_path / f"{name}.fastsched.jsonl"
    ours.write_text("\n".join(replay(TRACES / f"{name}.trace.json")) + "\n")
    result = subprocess.run(
        [sys.executable, str(COMPARE), "--show", "3", str(TRACES / f"{name}.vllm.jsonl"), str(ours)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"compare.py (vLLM = A, fastsched = B) exit {result.returncode}:\n{report}"
    assert "steps identical" in report and "warning" not in report, report


def vendored_files(root: Path) -> dict[str, bytes]:
    files = [root / "compare.py", root / "README.md", *sorted((root / "traces").iterdir())]
    return {str(p.relative_to(root)): p.read_bytes() for p in files if p.is_file()}


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"no shared conformance suite at {SHARED.resolve()}")
def test_vendored_suite_is_byte_identical_to_the_shared_one():
    shared, vendored = vendored_files(SHARED), vendored_files(SUITE)
    assert sorted(vendored) == sorted(shared), "the vendored file list differs from the shared suite"
    drifted = [name for name in shared if vendored[name] != shared[name]]
    assert not drifted, f"vendored copies differ from {SHARED.resolve()}: {drifted}"
