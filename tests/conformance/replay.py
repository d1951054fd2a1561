#!/usr/bin/env python3
"""Replay a scheduling trace through ``fastsched._core`` and write its decisions.

    replay.py TRACE.json --out DECISIONS.jsonl

Follows the replay protocol of the conformance suite (``vllm-diff-trace/1`` in,
``vllm-diff-decisions/1`` out): per step, add requests, apply aborts, call
``schedule()`` unless the scheduler has nothing to do, feed one token from the
trace's token function to every request whose prefill completed, and record
what was decided. The output can be diffed against vLLM's own decisions with
the suite's ``compare.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastsched import Scheduler, SchedulerConfig

FINISH_REASONS = {1: "stop", 2: "length"}
KIND_NEW, KIND_RESUMED = 1, 2


def sample_token(request_id: str, index: int, vocab_size: int, eos: int, stop_at: int | None) -> int:
    """The trace's ``fnv1a64-v1`` fake model: output ``index`` of ``request_id``."""
    if stop_at is not None and index == stop_at:
        return eos
    h = 0xCBF29CE484222325
    for b in f"{request_id}:{index}".encode():
        h = ((h ^ b) * 0x100000001B3) % (1 << 64)
    t = h % (vocab_size - 1)
    return t + 1 if t >= eos else t


def scheduler_config(cfg: dict) -> SchedulerConfig:
    """Maps the trace's config (vLLM names) onto ours; ``num_blocks`` includes the null block."""
    return SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"],
        max_num_active_seqs=cfg["max_num_active_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"],
        long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
        long_prefill_token_threshold_adaptive=cfg["long_prefill_token_threshold_adaptive"],
        prefill_schedule_interval=cfg["prefill_schedule_interval"],
        enable_chunked_prefill=cfg["enable_chunked_prefill"],
        policy=cfg["policy"],
        block_size=cfg["block_size"],
        num_gpu_blocks=cfg["num_blocks"],
        enable_prefix_caching=cfg["enable_prefix_caching"],
        scheduler_reserve_full_isl=cfg["scheduler_reserve_full_isl"],
        watermark=cfg["watermark"],
    )


@dataclass
class TracedRequest:
    eos_token_id: int
    stop_at: int | None
    num_tokens: int
    num_output_tokens: int = 0


def canonical(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def replay(trace_path: Path) -> list[str]:
    """Returns the decision lines (header first) for one trace file."""
    raw = trace_path.read_bytes()
    trace = json.loads(raw)
    if trace.get("format") != "vllm-diff-trace/1":
        raise ValueError(f"{trace_path}: format {trace.get('format')!r} is not vllm-diff-trace/1")
    vocab_size = trace["model"]["vocab_size"]
    sched = Scheduler(scheduler_config(trace["config"]))
    events = {e["step"]: e for e in trace["events"]}
    reqs: dict[str, TracedRequest] = {}
    lines = [
        canonical(
            {
                "header": {
                    "format": "vllm-diff-decisions/1",
                    "implementation": "fastsched._core.Scheduler",
                    "trace_sha256": hashlib.sha256(raw).hexdigest(),
                    "kind": trace["kind"],
                    "seed": trace["seed"],
                    "num_steps": trace["num_steps"],
                    "config": trace["config"],
                    "overrides": {},
                    "drop_aborts": False,
                }
            }
        )
    ]
    for step in range(trace["num_steps"]):
        event = events.get(step, {})
        for r in event.get("add", []):
            sched.add_request(
                r["request_id"],
                r["prompt_token_ids"],
                r["max_tokens"],
                eos_token_id=r["eos_token_id"],
                priority=r["priority"],
                arrival_time=r["arrival_time"],
            )
            reqs[r["request_id"]] = TracedRequest(r["eos_token_id"], r["stop_at"], len(r["prompt_token_ids"]))
        aborted = {}
        for rid in event.get("abort", []):
            status = sched.abort_request(rid)
            if status is not None:
                aborted[rid] = status
        line = {
            "step": step,
            "idle": True,
            "aborted": aborted,
            "scheduled": {},
            "total_tokens": 0,
            "new": [],
            "resumed": [],
            "preempted": [],
            "num_cached_tokens": {},
            "finished": {},
        }
        if sched.has_requests():
            line["idle"] = False
            out = sched.schedule()
            ids = sched.request_ids(out.req_handles)
            line["preempted"] = sorted(sched.request_ids(out.preempted))
            tokens = np.full(len(ids), -1, dtype=np.int64)
            for i, rid in enumerate(ids):
                n = int(out.num_scheduled_tokens[i])
                line["scheduled"][rid] = n
                kind = int(out.kinds[i])
                if kind in (KIND_NEW, KIND_RESUMED):
                    line["new" if kind == KIND_NEW else "resumed"].append(rid)
                    line["num_cached_tokens"][rid] = int(out.num_cached_tokens[i])
                tr = reqs[rid]
                if int(out.num_computed_tokens[i]) + n >= tr.num_tokens:
                    tokens[i] = sample_token(rid, tr.num_output_tokens, vocab_size, tr.eos_token_id, tr.stop_at)
            line["total_tokens"] = out.total_num_scheduled_tokens
            results = sched.update_from_tokens(tokens)
            result_ids = sched.request_ids(results.handles)
            for i, rid in enumerate(result_ids):
                new = int(results.token_offsets[i + 1] - results.token_offsets[i])
                reqs[rid].num_tokens += new
                reqs[rid].num_output_tokens += new
                reason = int(results.finish_reasons[i])
                if reason:
                    line["finished"][rid] = FINISH_REASONS[reason]
        line["new"].sort()
        line["resumed"].sort()
        line["running"] = sched.num_running
        line["waiting"] = sched.num_waiting
        line["kv_free_blocks"] = sched.num_free_blocks
        lines.append(canonical(line))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a vllm-diff-trace/1 JSON file")
    parser.add_argument("--out", type=Path, required=True, help="where to write the decisions (JSONL)")
    args = parser.parse_args(argv)
    lines = replay(args.trace)
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
