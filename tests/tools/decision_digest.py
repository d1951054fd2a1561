#!/usr/bin/env python3
"""Differential check of the scheduler: digests of every step's decisions on
random workloads, to compare two builds of ``fastsched._core``.

    decision_digest.py --out a.jsonl [--workloads N] [--steps S] [--seed X]
    decision_digest.py --compare a.jsonl b.jsonl

Each workload is a random config and trace, a pure function of ``(seed, i)``:
speculative decoding (drafts accepted by a fake verifier, given after the update or
with it, with and without lookahead slots, padded admissions), LoRA adapters,
small KV pools (preemption), shared prompt prefixes, aborts, streaming sessions,
the priority policy (and opt-in priority preemption), pauses, the prefill
interval, a test KV connector, and async scheduling (one step of lag). Every
step records what ``schedule()`` decided (every array of ``SchedulerOutput``),
what the update returned (every array of ``EngineCoreOutputs``) and the stats;
the line of a workload holds a short digest per step and one of them all.

Old vs new build (same tool file, run against each build of the extension)::

    git worktree add /tmp/old <old-commit>
    (cd /tmp/old && python3 -m venv .venv && .venv/bin/pip install -q numpy maturin \\
        && .venv/bin/maturin develop --release -q)
    /tmp/old/.venv/bin/python tests/tools/decision_digest.py --out /tmp/old.jsonl
    .venv/bin/maturin develop --release -q
    .venv/bin/python tests/tools/decision_digest.py --out /tmp/new.jsonl
    .venv/bin/python tests/tools/decision_digest.py --compare /tmp/old.jsonl /tmp/new.jsonl

(run the tool file of the newer checkout against both). ``--compare`` exits 0 iff
every workload's digests are identical, and otherwise names the first differing
workload and step. Output fields a build does not have are recorded as absent, so
a build that only added fields differs exactly where it adds them.
``tests/test_decision_digest.py`` runs a small set twice (the digests must match:
the scheduler is deterministic) in CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastsched import Scheduler, SchedulerConfig

EOS, STOP = 2, 3
OUTPUT_FIELDS = (
    "step_id", "total_num_scheduled_tokens", "req_handles", "num_scheduled_tokens", "num_computed_tokens",
    "kinds", "num_cached_tokens", "num_spec_tokens", "spec_token_ids", "block_offsets", "block_ids", "preempted",
    "finished", "skipped", "skip_reasons",
)  # fmt: skip
RESULT_FIELDS = (
    "handles",
    "token_offsets",
    "token_ids",
    "finish_reasons",
    "segment_ended",
    "num_cached_tokens",
)


def fnv1a64(text: str) -> int:
    h = 0xCBF29CE484222325
    for b in text.encode():
        h = ((h ^ b) * 0x100000001B3) % (1 << 64)
    return h


def model_token(rid: str, index: int) -> int:
    """The fake model's output ``index`` of ``rid``: EOS or a stop token now and then."""
    h = fnv1a64(f"{rid}:{index}")
    if h % 97 == 0:
        return EOS
    if h % 89 == 0:
        return STOP
    return 10 + h % 900


def drafts_for(rid: str, index: int, k: int) -> list[int]:
    """Drafts for ``rid`` at ``index`` outputs: mostly right, sometimes not."""
    out = []
    for j in range(k):
        t = model_token(rid, index + j)
        out.append(t if fnv1a64(f"{rid}:{index}:{j}:d") % 3 else t + 1)
    return out


@dataclass
class Workload:
    config: dict[str, Any]
    connector: bool
    async_lag: bool
    pauses: bool
    streaming: bool
    drafts_after: bool
    rng: random.Random = field(repr=False)


def make_workload(seed: int, i: int) -> Workload:
    rng = random.Random(f"decision-digest:{seed}:{i}")
    async_lag = rng.random() < 0.15
    k = 0 if async_lag else rng.choice([0, 0, 1, 2, 4])
    chunked = rng.random() < 0.85
    max_num_seqs = rng.choice([2, 4, 8, 16])
    max_model_len = 128
    block_size = rng.choice([4, 8, 16])
    policy = rng.choice(["fcfs", "priority"])
    cfg = dict(
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=rng.choice([None, None, max(1, max_num_seqs // 2)]),
        max_num_batched_tokens=rng.choice([32, 64, 128]) if chunked else max_model_len + 8,
        max_model_len=max_model_len,
        long_prefill_token_threshold=rng.choice([0, 0, 8, 24]),
        long_prefill_token_threshold_adaptive=rng.random() < 0.3,
        prefill_schedule_interval=rng.choice([1, 1, 3]),
        enable_chunked_prefill=chunked,
        policy=policy,
        max_loras=rng.choice([0, 0, 1, 2]),
        num_speculative_tokens=k,
        num_lookahead_tokens=rng.choice([0, k]),
        block_size=block_size,
        num_gpu_blocks=rng.randint(max_model_len // block_size + 1, 6 * max_model_len // block_size) + 1,
        enable_prefix_caching=rng.random() < 0.8,
        scheduler_reserve_full_isl=rng.random() < 0.8,
        watermark=rng.choice([0.0, 0.0, 0.05]),
        priority_preemption=policy == "priority" and rng.random() < 0.5,
    )
    cfg["max_num_batched_tokens"] = max(cfg["max_num_batched_tokens"], max_num_seqs, k + 1)
    return Workload(
        config=cfg,
        connector=rng.random() < 0.2,
        async_lag=async_lag,
        pauses=rng.random() < 0.3,
        streaming=rng.random() < 0.3,
        drafts_after=rng.random() < 0.5,
        rng=rng,
    )


def array_field(obj: Any, name: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        return None  # a build without this field
    return value.tolist() if isinstance(value, np.ndarray) else value


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Driver:
    def __init__(self, w: Workload, steps: int):
        self.w, self.steps, self.rng = w, steps, w.rng
        self.sched = Scheduler(SchedulerConfig(**w.config))
        if w.connector:
            self.sched.use_test_connector(2 * w.config["block_size"], 2)
        if w.async_lag:
            self.sched.set_async_scheduling(True)
        self.k = w.config["num_speculative_tokens"]
        self.ids: list[str] = []
        self.sessions: list[str] = []
        self.outputs: dict[str, int] = {}  # request id -> outputs appended
        self.families = [[self.rng.randrange(10, 900) for _ in range(48)] for _ in range(4)]
        self.in_flight: list[tuple[Any, list[str], list[bool]]] = []
        self.seen: dict[str, int] = {}  # what the workload exercised (--coverage)

    def count(self, what: str, n: int = 1) -> None:
        self.seen[what] = self.seen.get(what, 0) + int(n)

    def add(self, step: int) -> None:
        rid = f"r{len(self.ids)}"
        length = self.rng.randint(1, 100)
        family = self.rng.choice(self.families)
        shared = self.rng.randint(0, min(length, 48))
        prompt = family[:shared] + [self.rng.randrange(10, 900) for _ in range(length - shared)]
        streaming = self.w.streaming and self.rng.random() < 0.2
        lora = self.rng.randint(1, 4) if self.w.config["max_loras"] and self.rng.random() < 0.7 else None
        self.sched.add_request(
            rid,
            prompt,
            self.rng.randint(1, 40),
            eos_token_id=EOS,
            stop_token_ids=[STOP] if self.rng.random() < 0.2 else None,
            priority=self.rng.randint(0, 3),
            arrival_time=float(step) + len(self.ids) / 1024,
            lora_id=lora,
            streaming=streaming,
        )
        self.ids.append(rid)
        self.outputs[rid] = 0
        if streaming:
            self.sessions.append(rid)

    def events(self, step: int) -> None:
        arrivals = step < self.steps * 3 // 4
        for _ in range(self.rng.choice([0, 0, 1, 1, 2, 4]) if arrivals else 0):
            self.add(step)
        if self.ids and self.rng.random() < 0.07:
            self.sched.abort_request(self.rng.choice(self.ids))
        if self.w.pauses and self.rng.random() < 0.08:
            self.sched.set_pause_state(self.rng.choice(["unpaused", "unpaused", "paused_new", "paused_all"]))
        if not arrivals:
            self.sched.set_pause_state("unpaused")
        for rid in list(self.sessions):
            if self.rng.random() < 0.15:
                try:
                    if not arrivals or self.rng.random() < 0.3:
                        self.sessions.remove(rid)
                        self.sched.close_stream(rid)
                    else:
                        tokens = [self.rng.randrange(10, 900) for _ in range(self.rng.randint(1, 6))]
                        self.sched.add_stream_input(rid, tokens, self.rng.randint(1, 5))
                except (KeyError, ValueError):
                    if rid in self.sessions:
                        self.sessions.remove(rid)  # the session ended meanwhile

    def verify(self, out: Any, rows: list[str], samples: list[bool]) -> tuple[np.ndarray, np.ndarray]:
        """The fake model: a sampling row gets its accepted drafts plus one token."""
        spec = array_field(out, "spec_token_ids") or []
        offsets, tokens, at = [0], [], 0
        for i, rid in enumerate(rows):
            s = int(out.num_spec_tokens[i])
            drafts, at = spec[at : at + s], at + s
            if samples[i]:
                n = self.outputs.get(rid, 0)
                a = 0
                while a < len(drafts) and drafts[a] == model_token(rid, n + a):
                    a += 1
                tokens.extend(model_token(rid, n + j) for j in range(a + 1))
            offsets.append(len(tokens))
        return np.array(offsets, dtype=np.uint32), np.array(tokens, dtype=np.uint32)

    def update(self, out: Any, rows: list[str], samples: list[bool]) -> dict[str, Any]:
        offsets, tokens = self.verify(out, rows, samples)
        drafts_now = self.k > 0 and not self.w.drafts_after
        if drafts_now:
            d_off, d_ids = [0], []
            for i, rid in enumerate(rows):
                if samples[i]:
                    # Proposed for the output count after this update (if all land).
                    n = self.outputs.get(rid, 0) + int(offsets[i + 1] - offsets[i])
                    d_ids.extend(drafts_for(rid, n, self.k))
                d_off.append(len(d_ids))
            res = self.sched.update_from_output(
                offsets, tokens, np.array(d_off, dtype=np.uint32), np.array(d_ids, dtype=np.uint32)
            )
        else:
            res = self.sched.update_from_output(offsets, tokens)
        for i, h in enumerate(res.handles.tolist()):
            rid = self.sched.request_id(h)
            self.outputs[rid] = self.outputs.get(rid, 0) + int(
                res.token_offsets[i + 1] - res.token_offsets[i]
            )
        if self.k > 0 and self.w.drafts_after:
            handles, d_off, d_ids = [], [0], []
            for i, rid in enumerate(rows):
                if samples[i]:
                    handles.append(int(out.req_handles[i]))
                    d_ids.extend(drafts_for(rid, self.outputs[rid], self.k))
                    d_off.append(len(d_ids))
            self.sched.update_draft_token_ids(
                np.array(handles, dtype=np.uint32),
                np.array(d_off, dtype=np.uint32),
                np.array(d_ids, dtype=np.uint32),
            )
        self.count("tokens", len(tokens))
        self.count("finished", sum(1 for r in res.finish_reasons.tolist() if r))
        self.count("segments_ended", sum(res.segment_ended.tolist()))
        return {name: array_field(res, name) for name in RESULT_FIELDS}

    def run(self) -> list[str]:
        step_digests = []
        for step in range(self.steps):
            self.events(step)
            record: dict[str, Any] = {"step": step, "idle": not self.sched.has_requests()}
            if not record["idle"]:
                out = self.sched.schedule()
                rows = [self.sched.request_id(h) for h in out.req_handles.tolist()]
                samples = []
                for h in out.req_handles.tolist():
                    info = self.sched.request_info(h)
                    samples.append(info["num_computed_tokens"] >= info["num_tokens"])
                record["schedule"] = sched = {name: array_field(out, name) for name in OUTPUT_FIELDS}
                self.count("steps")
                self.count("preempted", len(sched["preempted"]))
                self.count("skipped", len(sched["skipped"] or []))
                self.count("draft_rows", sum(1 for n in sched["num_spec_tokens"] if n))
                self.count(
                    "padded_rows", sum(1 for n, k in zip(sched["num_spec_tokens"], sched["kinds"]) if n and k)
                )
                self.count("resumed", sum(1 for k in sched["kinds"] if k == 2))
                self.in_flight.append((out, rows, samples))
                if not self.w.async_lag or len(self.in_flight) > 1:
                    record["update"] = self.update(*self.in_flight.pop(0))
            elif self.in_flight:
                record["update"] = self.update(*self.in_flight.pop(0))
            stats = self.sched.stats()
            record["stats"] = {k: stats[k] for k in sorted(stats)}
            step_digests.append(digest(record)[:16])
            self.count("paused_steps", not record["idle"] and stats["last_scan_stop"] == "paused")
        return step_digests


def run_workloads(
    num_workloads: int, steps: int, seed: int, seen: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    lines = []
    for i in range(num_workloads):
        w = make_workload(seed, i)
        driver = Driver(w, steps)
        step_digests = driver.run()
        if seen is not None:
            for what, n in driver.seen.items():
                seen[what] = seen.get(what, 0) + n
        lines.append(
            {
                "workload": i,
                "seed": seed,
                "config": w.config,
                "flags": {"connector": w.connector, "async_lag": w.async_lag, "pauses": w.pauses,
                          "streaming": w.streaming, "drafts_after": w.drafts_after},
                "digest": digest(step_digests),
                "steps": step_digests,
            }
        )  # fmt: skip
    return lines


def compare(a_path: Path, b_path: Path) -> int:
    a = [json.loads(x) for x in a_path.read_text().splitlines() if x.strip()]
    b = [json.loads(x) for x in b_path.read_text().splitlines() if x.strip()]
    if [(x["workload"], x["seed"]) for x in a] != [(x["workload"], x["seed"]) for x in b]:
        print("the two files hold different workloads (--workloads/--seed differ)")
        return 2
    differing = [(x, y) for x, y in zip(a, b) if x["digest"] != y["digest"]]
    for x, y in differing[:5]:
        step = next(i for i, (s, t) in enumerate(zip(x["steps"], y["steps"])) if s != t)
        print(
            f"workload {x['workload']}: first differing step {step}; config {x['config']} flags {x['flags']}"
        )
    print(f"{len(a) - len(differing)}/{len(a)} workloads identical")
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write one JSON line per workload here")
    p.add_argument("--workloads", type=int, default=100)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two --out files")
    p.add_argument("--coverage", action="store_true", help="also print what the workloads exercised")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        p.error("--out or --compare is required")
    seen: dict[str, int] = {}
    lines = run_workloads(args.workloads, args.steps, args.seed, seen)
    args.out.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
    print(f"{len(lines)} workloads x {args.steps} steps -> {args.out}")
    if args.coverage:
        print("exercised: " + ", ".join(f"{what} {n}" for what, n in sorted(seen.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
