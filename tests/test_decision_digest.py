"""The differential tool ``tests/tools/decision_digest.py`` in CI: a small set of
its random workloads (drafts, LoRA, preemption, prefixes, aborts, streaming,
priority, pauses, a connector, async scheduling) replayed twice must give the
same digest at every step. Comparing two builds is its manual mode (see the
tool's docstring)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent / "tools" / "decision_digest.py"
spec = importlib.util.spec_from_file_location("decision_digest", TOOL)
assert spec is not None and spec.loader is not None
decision_digest = importlib.util.module_from_spec(spec)
sys.modules["decision_digest"] = decision_digest
spec.loader.exec_module(decision_digest)

WORKLOADS, STEPS = 12, 120


def test_decision_digests_of_two_runs_are_identical_at_every_step(tmp_path: Path):
    seen: dict[str, int] = {}
    a = decision_digest.run_workloads(WORKLOADS, STEPS, seed=7, seen=seen)
    b = decision_digest.run_workloads(WORKLOADS, STEPS, seed=7)
    assert [x["steps"] for x in a] == [x["steps"] for x in b]
    for what in ("preempted", "draft_rows", "skipped", "finished", "segments_ended", "resumed"):
        assert seen.get(what, 0) > 0, f"the workloads never exercised {what}: {seen}"
    for name, lines in (("a", a), ("b", b)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert decision_digest.compare(tmp_path / "a.jsonl", tmp_path / "b.jsonl") == 0


def test_compare_names_the_first_differing_workload_and_step(tmp_path: Path, capsys):
    lines = decision_digest.run_workloads(2, 30, seed=3)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    lines[1]["steps"][17] = "0" * 16
    lines[1]["digest"] = "changed"
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert decision_digest.compare(tmp_path / "a.jsonl", tmp_path / "b.jsonl") == 1
    assert "workload 1: first differing step 17" in capsys.readouterr().out
