#!/usr/bin/env python3
"""Replay a scheduling trace through ``fastsched._core`` and write its decisions.

    replay.py TRACE.json --out DECISIONS.jsonl

Follows the replay protocol of the conformance suite: ``vllm-diff-trace/1`` in,
``vllm-diff-decisions/1`` out (``vllm/README.md``), and ``vllm-diff-trace/2`` in,
``vllm-diff-decisions/2`` out (``vllm/v2/README.md``). Per step: add requests
(with their LoRA adapter), apply aborts, set the pause state, call ``schedule()``
unless the scheduler has nothing to do, verify the scheduled drafts and feed the
sampled tokens from the trace's token function, propose the next drafts by the
trace's draft rule, and record what was decided. The output can be diffed against
vLLM's own decisions with the suite's ``compare.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastsched import Scheduler, SchedulerConfig

FORMATS = {"vllm-diff-trace/1": 1, "vllm-diff-trace/2": 2}
FINISH_REASONS = {1: "stop", 2: "length"}
KIND_NEW, KIND_RESUMED = 1, 2
SKIP_LORA_SLOTS = 0  # ``SkipReason::LoraSlots``
# Trace pause names -> the binding's (vLLM's PAUSED_NEW / PAUSED_ALL / UNPAUSED).
PAUSE_STATES = {"unpaused": "unpaused", "new": "paused_new", "all": "paused_all"}


def fnv1a64(text: str) -> int:
    h = 0xCBF29CE484222325
    for b in text.encode():
        h = ((h ^ b) * 0x100000001B3) % (1 << 64)
    return h


def sample_token(request_id: str, index: int, vocab_size: int, eos: int, stop_at: int | None) -> int:
    """The trace's ``fnv1a64-v1`` fake model: output ``index`` of ``request_id``."""
    if stop_at is not None and index == stop_at:
        return eos
    t = fnv1a64(f"{request_id}:{index}") % (vocab_size - 1)
    return t + 1 if t >= eos else t


def draft_tokens(
    request_id: str, index: int, k: int, vocab_size: int, eos: int, stop_at: int | None
) -> list[int]:
    """The trace's ``fnv1a64-draft-v1`` rule: the ``k`` drafts proposed for ``request_id``
    when it has ``index`` outputs. Three in four are the token the model will sample;
    the others are never it."""
    drafts = []
    for j in range(k):
        t = sample_token(request_id, index + j, vocab_size, eos, stop_at)
        h = fnv1a64(f"{request_id}:{index}:{j}:d")
        drafts.append(t if h % 4 != 0 else (t + 1 + (h >> 32) % (vocab_size - 1)) % vocab_size)
    return drafts


def scheduler_config(cfg: dict) -> SchedulerConfig:
    """Maps the trace's config (vLLM names) onto ours; ``num_blocks`` includes the null block.

    v2's speculative decoding is vLLM's ``ngram`` method with drafts supplied by the
    replay: no lookahead KV slots and no input slots for drafting, which is our
    default ``num_lookahead_tokens = 0``."""
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
        num_speculative_tokens=cfg.get("num_speculative_tokens", 0),
        max_loras=cfg.get("max_loras", 0),
    )


@dataclass
class TracedRequest:
    eos_token_id: int
    stop_at: int | None
    num_tokens: int
    num_output_tokens: int = 0


def canonical(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def header(trace: dict, raw: bytes, version: int) -> dict:
    h = {
        "format": f"vllm-diff-decisions/{version}",
        "implementation": "fastsched._core.Scheduler",
        "trace_sha256": hashlib.sha256(raw).hexdigest(),
        "kind": trace["kind"],
        "seed": trace["seed"],
        "num_steps": trace["num_steps"],
        "config": trace["config"],
        "overrides": {},
        "drop_aborts": False,
    }
    if version == 2:
        h["drop_pause"] = False
    return {"header": h}


def replay(trace_path: Path, probe: Callable[[int, Scheduler], None] | None = None) -> list[str]:
    """Returns the decision lines (header first) for one trace file.

    ``probe(step, scheduler)``, if given, is called right before each
    ``schedule()``, so that a test can read the state the step starts from."""
    raw = trace_path.read_bytes()
    trace = json.loads(raw)
    version = FORMATS.get(trace.get("format"))
    if version is None:
        raise ValueError(f"{trace_path}: format {trace.get('format')!r} is not one of {sorted(FORMATS)}")
    vocab_size = trace["model"]["vocab_size"]
    k = trace["config"].get("num_speculative_tokens", 0)
    sched = Scheduler(scheduler_config(trace["config"]))
    events = {e["step"]: e for e in trace["events"]}
    reqs: dict[str, TracedRequest] = {}
    pause = "unpaused"
    lines = [canonical(header(trace, raw, version))]

    def token(rid: str, index: int) -> int:
        tr = reqs[rid]
        return sample_token(rid, index, vocab_size, tr.eos_token_id, tr.stop_at)

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
                lora_id=r.get("lora_id"),
            )
            reqs[r["request_id"]] = TracedRequest(r["eos_token_id"], r["stop_at"], len(r["prompt_token_ids"]))
        aborted = {}
        for rid in event.get("abort", []):
            status = sched.abort_request(rid)
            if status is not None:
                aborted[rid] = status
        if "pause" in event:
            pause = event["pause"]
            sched.set_pause_state(PAUSE_STATES[pause])
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
        spec_tokens: dict[str, int] = {}
        accepted: dict[str, int] = {}
        spec_padded: list[str] = []
        lora_skipped: list[str] = []
        if sched.has_requests():
            line["idle"] = False
            if probe is not None:
                probe(step, sched)
            out = sched.schedule()
            ids = sched.request_ids(out.req_handles)
            line["preempted"] = sorted(sched.request_ids(out.preempted))
            skipped = sched.request_ids(out.skipped)
            lora_skipped = sorted(
                rid for rid, why in zip(skipped, out.skip_reasons) if why == SKIP_LORA_SLOTS
            )
            offsets = [0]
            sampled: list[int] = []
            spec_at = 0
            samples: set[str] = set()  # ids whose prefill completes this step
            for i, rid in enumerate(ids):
                n = int(out.num_scheduled_tokens[i])
                line["scheduled"][rid] = n
                kind = int(out.kinds[i])
                if kind in (KIND_NEW, KIND_RESUMED):
                    line["new" if kind == KIND_NEW else "resumed"].append(rid)
                    line["num_cached_tokens"][rid] = int(out.num_cached_tokens[i])
                tr = reqs[rid]
                s = int(out.num_spec_tokens[i])
                drafts = [int(d) for d in out.spec_token_ids[spec_at : spec_at + s]]
                spec_at += s
                if int(out.num_computed_tokens[i]) + n >= tr.num_tokens:
                    # Verification: the longest prefix of drafts the model agrees with,
                    # then its own token (the bonus, or the correction).
                    a = 0
                    while a < s and drafts[a] == token(rid, tr.num_output_tokens + a):
                        a += 1
                    sampled.extend(token(rid, tr.num_output_tokens + j) for j in range(a + 1))
                    samples.add(rid)
                    if s:
                        spec_tokens[rid], accepted[rid] = s, a
                        if all(d == -1 for d in drafts):
                            spec_padded.append(rid)
                offsets.append(len(sampled))
            line["total_tokens"] = out.total_num_scheduled_tokens
            results = sched.update_from_output(
                np.array(offsets, dtype=np.uint32), np.array(sampled, dtype=np.uint32)
            )
            result_ids = sched.request_ids(results.handles)
            finished = set()
            for i, rid in enumerate(result_ids):
                new = int(results.token_offsets[i + 1] - results.token_offsets[i])
                reqs[rid].num_tokens += new
                reqs[rid].num_output_tokens += new
                reason = int(results.finish_reasons[i])
                if reason:
                    line["finished"][rid] = FINISH_REASONS[reason]
                    finished.add(rid)
            if k > 0 and out.total_num_scheduled_tokens > 0:
                # EngineCore.post_step: drafts for every live request of the step
                # whose prefill is complete, for its new output count.
                handles, draft_offsets, proposed = [], [0], []
                for i, rid in enumerate(ids):
                    if rid in finished or rid not in samples:
                        continue
                    tr = reqs[rid]
                    handles.append(int(out.req_handles[i]))
                    proposed.extend(
                        draft_tokens(rid, tr.num_output_tokens, k, vocab_size, tr.eos_token_id, tr.stop_at)
                    )
                    draft_offsets.append(len(proposed))
                sched.update_draft_token_ids(
                    np.array(handles, dtype=np.uint32),
                    np.array(draft_offsets, dtype=np.uint32),
                    np.array(proposed, dtype=np.uint32),
                )
        line["new"].sort()
        line["resumed"].sort()
        line["running"] = sched.num_running
        line["waiting"] = sched.num_waiting
        line["kv_free_blocks"] = sched.num_free_blocks
        if version == 2:
            line["pause"] = pause
            line["spec_tokens"] = spec_tokens
            line["accepted"] = accepted
            line["spec_padded"] = sorted(spec_padded)
            line["lora_skipped"] = lora_skipped
        lines.append(canonical(line))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path, help="a vllm-diff-trace/1 or /2 JSON file")
    parser.add_argument("--out", type=Path, required=True, help="where to write the decisions (JSONL)")
    args = parser.parse_args(argv)
    lines = replay(args.trace)
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
