"""How long one scheduling step costs through the Python binding.

The trace keeps ``--running`` requests in flight and ``--waiting`` more
queued behind them (``max_num_seqs = --running``). Prompts have a uniformly
random length in [prompt_len/2, 3*prompt_len/2] and random token ids; output
lengths are uniform in [output_len/2, 3*output_len/2] and are passed as
``max_tokens``, so every request ends with finish reason 2 (length) and is
replaced by a fresh one at once: the load stays constant.

Each step calls ``schedule()``, gives one sampled token to every request
whose prefill completed in that step (never EOS: ``eos_token_id=None``),
then calls ``update_from_tokens()``. Only those two calls are timed
(``time.perf_counter_ns`` around each); the model is not simulated, so the
figure is the scheduler's own overhead per forward pass, boundary crossing
and numpy conversion included. The first ``--warmup`` steps are not counted.

Building the token array (which requests sample) and adding replacement
requests are not timed; the former is vectorised (one numpy array of each
handle's current token count, indexed by handle) and its cost is printed
separately so a reader can see what an engine would add on top. Under
``--policy priority`` requests get a random priority in 0..3.

``steps/s`` is measured steps over their total timed time, so it includes
outliers (a context switch inside a timed call); on a shared machine read
the median. KV usage is sampled after each step's update.

The table goes to stdout, the progress bar to stderr, and the last line of
stdout is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace

# No BLAS here: keep OpenBLAS from starting threads that compete for the cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from fastsched import _core

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is in the dev venv
    tqdm = None

VOCAB_SIZE = 32000
PRIORITY_LEVELS = 4


@dataclass(frozen=True)
class Workload:
    """The trace's shape, derived once from the flags."""

    running: int
    waiting: int
    min_prompt: int
    max_prompt: int
    min_output: int
    max_output: int
    max_model_len: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    policy: str
    prefix_caching: bool

    @property
    def blocks_per_request(self) -> int:
        """KV blocks one request holds at its longest."""
        return -(-(self.max_prompt + self.max_output) // self.block_size)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, default=1024, help="requests in flight (= max_num_seqs)")
    p.add_argument("--waiting", type=int, default=256, help="requests queued behind them")
    p.add_argument("--steps", type=int, default=2000, help="measured steps")
    p.add_argument("--warmup", type=int, default=200, help="steps run before measuring")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --running")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="default: 8192, or max_num_seqs when that is larger",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool incl. the null block; default: every request at full length, plus one",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--prefix-caching-hash-algo",
        choices=("builtin", "sha256"),
        default="builtin",
        help="how block hashes are computed (the engine's flag of the same name)",
    )
    args = p.parse_args(argv)

    for name in ("running", "steps", "prompt_len", "output_len", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1")
    if args.waiting < 0 or args.warmup < 0:
        p.error("--waiting and --warmup must be non-negative")
    if args.max_num_seqs is None:
        args.max_num_seqs = args.running
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(8192, args.max_num_seqs)
    elif args.max_num_batched_tokens < args.max_num_seqs:
        p.error(
            f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least "
            f"max_num_seqs ({args.max_num_seqs}): every running request may need a token per step"
        )
    return args


def make_workload(args: argparse.Namespace) -> Workload:
    min_prompt, max_prompt = max(1, args.prompt_len // 2), max(1, 3 * args.prompt_len // 2)
    min_output, max_output = max(1, args.output_len // 2), max(1, 3 * args.output_len // 2)
    w = Workload(
        running=args.running,
        waiting=args.waiting,
        min_prompt=min_prompt,
        max_prompt=max_prompt,
        min_output=min_output,
        max_output=max_output,
        # One spare position so every request ends by max_tokens, not by length cap.
        max_model_len=max_prompt + max_output + 1,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=0,
        block_size=args.block_size,
        policy=args.policy,
        prefix_caching=not args.no_prefix_caching,
    )
    ample = (args.running + args.waiting) * w.blocks_per_request + 1
    return replace(w, num_blocks=args.num_blocks or ample)


class Trace:
    """Adds random requests and tracks each handle's current token count."""

    def __init__(self, sched: _core.Scheduler, w: Workload, rng: np.random.Generator):
        self.sched = sched
        self.w = w
        self.rng = rng
        self.next_id = 0
        # Indexed by handle; handles are small integers the scheduler reuses.
        self.num_tokens = np.zeros(2 * (w.running + w.waiting) + 64, dtype=np.int64)

    def sample(self, so: _core.SchedulerOutput, sampled: np.ndarray) -> np.ndarray:
        """One token for each request whose prefill completes this step, -1 for the rest."""
        handles = so.req_handles
        done = so.num_computed_tokens + so.num_scheduled_tokens >= self.num_tokens.take(handles)
        return np.where(done, sampled[: len(handles)], -1)

    def record(self, out: _core.EngineCoreOutputs) -> int:
        """Counts the new tokens per handle; returns how many requests finished."""
        # intp indices: numpy's fancy assignment is ~10x slower with uint32 ones.
        progressed = out.handles.astype(np.intp)
        new_tokens = out.token_offsets[1:] - out.token_offsets[:-1]
        self.num_tokens[progressed] = self.num_tokens.take(progressed) + new_tokens
        return int(np.count_nonzero(out.finish_reasons))

    def add(self, count: int, now: float) -> None:
        w, rng = self.w, self.rng
        prompt_lens = rng.integers(w.min_prompt, w.max_prompt + 1, size=count)
        output_lens = rng.integers(w.min_output, w.max_output + 1, size=count)
        priorities = rng.integers(0, PRIORITY_LEVELS, size=count)
        tokens = rng.integers(0, VOCAB_SIZE, size=int(prompt_lens.sum())).tolist()
        start = 0
        rows = zip(prompt_lens.tolist(), output_lens.tolist(), priorities.tolist())
        for plen, olen, prio in rows:
            h = self.sched.add_request(
                f"r{self.next_id}",
                tokens[start : start + plen],
                olen,
                eos_token_id=None,
                priority=prio,
                arrival_time=now,
            )
            start += plen
            self.next_id += 1
            if h >= len(self.num_tokens):
                self.num_tokens = np.concatenate([self.num_tokens, np.zeros_like(self.num_tokens)])
            self.num_tokens[h] = plen


def progress(total: int):
    """tqdm when installed, else a line every ~10% on stderr."""
    if tqdm is not None:
        return tqdm(range(total), desc="steps", file=sys.stderr, mininterval=0.5, leave=False)

    def plain():
        every = max(1, total // 10)
        for i in range(total):
            if i % every == 0:
                print(f"steps {i}/{total}", file=sys.stderr, flush=True)
            yield i

    return plain()


def run(args: argparse.Namespace) -> dict:
    w = make_workload(args)
    cfg = _core.SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        policy=w.policy,
        block_size=w.block_size,
        num_gpu_blocks=w.num_blocks,
        enable_prefix_caching=w.prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
    )
    sched = _core.Scheduler(cfg)
    rng = np.random.default_rng(args.seed)
    trace = Trace(sched, w, rng)
    trace.add(w.running + w.waiting, now=0.0)

    total = args.warmup + args.steps
    sched_ns = np.zeros(args.steps, dtype=np.int64)
    update_ns = np.zeros(args.steps, dtype=np.int64)
    python_ns = np.zeros(args.steps, dtype=np.int64)
    num_reqs = np.zeros(args.steps, dtype=np.int64)
    num_tokens = np.zeros(args.steps, dtype=np.int64)
    kv_usage = np.zeros(args.steps, dtype=np.float64)
    sampled = rng.integers(0, VOCAB_SIZE, size=max(1, args.max_num_seqs), dtype=np.int64)
    clock = time.perf_counter_ns
    preemptions_before = 0
    replaced = 0

    for step in progress(total):
        if step == args.warmup:
            preemptions_before = sched.stats()["num_preemptions_total"]
        t0 = clock()
        so = sched.schedule()
        t1 = clock()
        tokens = trace.sample(so, sampled)
        t2 = clock()
        out = sched.update_from_tokens(tokens)
        t3 = clock()
        num_finished = trace.record(out)
        t4 = clock()
        if num_finished:
            trace.add(num_finished, now=float(step))
            replaced += num_finished
        i = step - args.warmup
        if i >= 0:
            sched_ns[i] = t1 - t0
            update_ns[i] = t3 - t2
            python_ns[i] = (t2 - t1) + (t4 - t3)
            num_reqs[i] = so.num_reqs
            num_tokens[i] = so.total_num_scheduled_tokens
            kv_usage[i] = sched.stats()["kv_cache_usage"]

    stats = sched.stats()
    step_us = (sched_ns + update_ns) / 1e3
    return {
        "workload": w,
        "args": args,
        "schedule_us": sched_ns / 1e3,
        "update_us": update_ns / 1e3,
        "python_us": python_ns / 1e3,
        "step_us": step_us,
        "num_reqs": num_reqs,
        "num_tokens": num_tokens,
        "kv_usage": kv_usage,
        "preemptions": stats["num_preemptions_total"] - preemptions_before,
        "preemptions_total": stats["num_preemptions_total"],
        "replaced": replaced,
    }


def report(r: dict) -> dict:
    w: Workload = r["workload"]
    args = r["args"]
    step_us = r["step_us"]
    steps_per_s = len(step_us) / (step_us.sum() / 1e6)
    kv = r["kv_usage"]
    config = [
        ("running (max_num_seqs)", args.max_num_seqs),
        ("waiting", w.waiting),
        ("steps", args.steps),
        ("warmup", args.warmup),
        ("prompt len", f"{w.min_prompt}-{w.max_prompt}"),
        ("output len", f"{w.min_output}-{w.max_output}"),
        ("max_num_batched_tokens", w.max_num_batched_tokens),
        ("max_model_len", w.max_model_len),
        ("num_blocks", w.num_blocks),
        ("block_size", w.block_size),
        ("policy", w.policy),
        ("prefix caching", "on" if w.prefix_caching else "off"),
        ("hash algo", args.prefix_caching_hash_algo),
        ("seed", args.seed),
    ]
    cells = [f"{name:<24}{value!s:>9}" for name, value in config]
    lines = [
        "fastsched scheduler bench (fastsched._core, schedule() + update_from_tokens())",
        "",
        "config",
        *("  " + "    ".join(cells[i : i + 2]) for i in range(0, len(cells), 2)),
        "",
        f"  {'µs per step':<28}{'median':>9}{'p90':>9}{'p99':>9}{'mean':>9}",
    ]
    for name, a in (
        ("schedule()", r["schedule_us"]),
        ("update_from_tokens()", r["update_us"]),
        ("step (both, timed)", step_us),
        ("python side (not timed)", r["python_us"]),
    ):
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        lines.append(f"  {name:<28}{p50:>9.1f}{p90:>9.1f}{p99:>9.1f}{a.mean():>9.1f}")
    lines += [
        "",
        f"  steps/s (timed calls only)        {steps_per_s:>12.0f}",
        f"  mean scheduled reqs / step        {r['num_reqs'].mean():>12.1f}",
        f"  mean scheduled tokens / step      {r['num_tokens'].mean():>12.1f}",
        f"  preemptions (measured steps)      {r['preemptions']:>12}",
        f"  kv usage mean / max               {kv.mean():>11.1%} / {kv.max():.1%}",
        f"  requests finished and replaced    {r['replaced']:>12}",
    ]
    print("\n".join(lines))
    p50, p90, p99 = np.percentile(step_us, [50, 90, 99])
    return {
        "median_us": round(float(p50), 2),
        "p90_us": round(float(p90), 2),
        "p99_us": round(float(p99), 2),
        "steps_per_s": round(float(steps_per_s), 1),
        "mean_scheduled_reqs": round(float(r["num_reqs"].mean()), 2),
        "mean_scheduled_tokens": round(float(r["num_tokens"].mean()), 2),
        "preemptions": int(r["preemptions"]),
        "schedule_median_us": round(float(np.median(r["schedule_us"])), 2),
        "update_median_us": round(float(np.median(r["update_us"])), 2),
        "python_median_us": round(float(np.median(r["python_us"])), 2),
        "kv_usage_mean": round(float(r["kv_usage"].mean()), 4),
        "running": args.max_num_seqs,
        "waiting": w.waiting,
        "steps": args.steps,
    }


def main(argv: list[str] | None = None) -> None:
    summary = report(run(parse_args(argv)))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
