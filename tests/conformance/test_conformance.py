"""Conformance with vLLM 0.33's V1 scheduler: every trace of the suite, replayed
through ``fastsched._core`` by ``replay.py``, must give the same decisions as
vLLM's own replay, step for step, ``kv_free_blocks`` included.

Two suites are vendored here as the project's own copies (they started as the
shared spec material; a clean clone tests without it): ``vllm/`` holds format 1
(``vllm-diff-trace/1``: budgets, chunking, preemption, prefixes, aborts, the
prefill interval) and ``vllm/v2/`` format 2 (``vllm-diff-trace/2``: speculative
decoding with replayed drafts, LoRA slots, pause states). Each trace is compared
with its own suite's ``compare.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from replay import replay

HERE = Path(__file__).resolve().parent
SUITES = {1: HERE / "vllm", 2: HERE / "vllm" / "v2"}
V1_KINDS = {
    "aborts", "active_cap", "basic", "chunked", "interval", "long_prefill", "mixed", "preempt_fcfs",
    "preempt_priority", "prefix",
}  # fmt: skip
V2_KINDS = {"spec", "lora", "pause", "mixed2"}


def trace_names(version: int) -> list[str]:
    return sorted(
        p.name.removesuffix(".trace.json") for p in (SUITES[version] / "traces").glob("*.trace.json")
    )


CASES = [(version, name) for version in SUITES for name in trace_names(version)]


@pytest.mark.parametrize("version, kinds", [(1, V1_KINDS), (2, V2_KINDS)])
def test_vendored_suite_has_a_reference_for_every_trace_and_kind(version: int, kinds: set[str]):
    suite = SUITES[version]
    names = trace_names(version)
    assert names, f"expected the suite's traces under {suite / 'traces'}"
    missing = [name for name in names if not (suite / "traces" / f"{name}.vllm.jsonl").is_file()]
    assert not missing, f"traces without vLLM decisions: {missing}"
    assert (suite / "compare.py").is_file() and (suite / "README.md").is_file()
    found = {json.loads((suite / "traces" / f"{name}.trace.json").read_text())["kind"] for name in names}
    assert kinds <= found, f"kinds without a trace: {sorted(kinds - found)}"
    formats = {json.loads((suite / "traces" / f"{name}.trace.json").read_text())["format"] for name in names}
    assert formats == {f"vllm-diff-trace/{version}"}


@pytest.mark.parametrize("version, name", CASES, ids=[f"v{v}-{n}" for v, n in CASES])
def test_replay_matches_vllm_decisions_at_every_step(version: int, name: str, tmp_path: Path):
    suite = SUITES[version]
    ours = tmp_path / f"{name}.fastsched.jsonl"
    lines = replay(suite / "traces" / f"{name}.trace.json")
    assert json.loads(lines[0])["header"]["format"] == f"vllm-diff-decisions/{version}"
    ours.write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [
            sys.executable,
            str(suite / "compare.py"),
            "--show",
            "3",
            str(suite / "traces" / f"{name}.vllm.jsonl"),
            str(ours),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"compare.py (vLLM = A, fastsched = B) exit {result.returncode}:\n{report}"
    num_steps = len(lines) - 1
    assert f"{num_steps}/{num_steps} steps identical" in report and "warning" not in report, report
