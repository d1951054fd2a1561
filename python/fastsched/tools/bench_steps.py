"""``fastsched bench fit-step-cost`` and ``fastsched bench steps``: the step-cost model for
``fastsched simulate``, fitted on step traces.

``fit-step-cost`` fits any ``--step-trace`` file. A served engine's trace is the one to
fit for predicting a server: its steps are timed as the engine loop sees them, output
sending and input draining included. ``steps`` needs no server: it loads the model in
this process, runs a sweep of batch shapes through a real ``EngineCore`` — decode-only
batches of growing size, prefill chunks of growing length, and decodes with a prefill
chunk beside them — records their step trace and fits it. Its steps are the
``EngineCore.step()`` calls alone, so it measures the model and the scheduler, not the
serving path around them.

Wiring (``fastsched.entrypoints.cli``)::

    from fastsched.tools.bench_steps import add_bench_steps_parsers
    add_bench_steps_parsers(bench_sub)   # `bench fit-step-cost` and `bench steps`
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastsched.engine.core import EngineCore
    from fastsched.tools.simulator.cost import StepCostFit

# Prompt token ids of the sweep's requests: byte tokens every byte-level BPE vocabulary has.
TOKEN_ID_RANGE = (10, 250)
MIN_PREFILL = 16


def add_bench_steps_parsers(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from fastsched.config import add_engine_args

    fit = bench_sub.add_parser(
        "fit-step-cost",
        help="fit the step-cost model of `fastsched simulate` on --step-trace files",
        description="Fit t_step = a + b*batched_tokens + c*running_reqs (non-negative least squares) on the "
        "steps of one or more --step-trace files; print a, b, c, R^2, the number of steps and the "
        "spread of the residuals, and write them as JSON for `fastsched simulate --cost-model`.",
    )
    fit.add_argument(
        "traces", nargs="+", metavar="TRACE", help="JSONL step traces (an engine's --step-trace)"
    )
    fit.add_argument("--out", default=None, metavar="FILE", help="write the fitted model as JSON to FILE")
    fit.set_defaults(func=run_fit_step_cost)

    steps = bench_sub.add_parser(
        "steps",
        help="measure and fit the step cost of a model in this process (no server)",
        description="Load the model in this process and run a sweep of batch shapes through a real EngineCore "
        "(decode-only batches of 1, 2, 4, ... requests; prefill chunks of 16, 32, ... tokens; "
        "decodes with a prefill chunk beside them), record every step (--step-trace, or a temporary "
        "file) and fit the step-cost model of `fastsched simulate` on it. Steps are timed as the "
        "EngineCore.step() call: the model and the scheduler, not a server's HTTP/gRPC/ZMQ path "
        "(fit a served engine's --step-trace for that).",
    )
    sweep = steps.add_argument_group("sweep")
    sweep.add_argument("--repeats", type=int, default=4, help="steps measured per batch shape")
    sweep.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="largest decode batch, in requests (default: --max-num-seqs)",
    )
    sweep.add_argument(
        "--max-prefill",
        type=int,
        default=None,
        help="longest prefill chunk, in tokens (default: --max-num-batched-tokens, within --max-model-len)",
    )
    sweep.add_argument(
        "--decode-context",
        type=int,
        default=128,
        help="prompt length of the decoding requests, in tokens (attention reads it each step)",
    )
    steps.add_argument("--out", default=None, metavar="FILE", help="write the fitted model as JSON to FILE")
    steps.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(steps)
    steps.set_defaults(func=run_bench_steps)


def run_fit_step_cost(args: argparse.Namespace) -> int:
    from fastsched.tools.simulator.cost import fit_step_cost, read_step_trace

    fit = fit_step_cost(read_step_trace(args.traces), source=", ".join(args.traces))
    _report(fit, args.out)
    return 0


def _report(fit: StepCostFit, out: str | None) -> None:
    from fastsched.tools.simulator.cost import format_fit

    print(f"step cost fitted on {fit.source}")
    print(format_fit(fit))
    if out:
        Path(out).write_text(json.dumps(fit.to_json(), indent=2) + "\n")
        print(f"wrote {out}")


@dataclass(frozen=True)
class Shape:
    """A batch to hold for ``repeats`` steps: ``decodes`` requests decoding, and one new
    request with a ``prefill``-token prompt admitted beside them at each step (0: none)."""

    decodes: int
    prefill: int


def sweep_shapes(max_batch: int, max_prefill: int, budget: int) -> list[Shape]:
    """Decode batches 1, 2, 4, ... ``max_batch``; prefill chunks 16, 32, ... ``max_prefill``;
    and the largest and a middle decode batch each beside a short and a long chunk that fit
    the step's token ``budget``."""
    decodes = _doubling(1, max_batch)
    prefills = _doubling(MIN_PREFILL, max_prefill) if max_prefill >= MIN_PREFILL else []
    shapes = [Shape(d, 0) for d in decodes] + [Shape(0, p) for p in prefills]
    for d in sorted({decodes[len(decodes) // 2], decodes[-1]}):
        for p in sorted({p for p in (prefills[:1] + prefills[-1:]) if p + d <= budget}):
            shapes.append(Shape(d, p))
    return shapes


def _doubling(lo: int, hi: int) -> list[int]:
    values, v = [], lo
    while v < hi:
        values.append(v)
        v *= 2
    return values + [hi]


def run_bench_steps(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from fastsched.config import EngineConfig, engine_kwargs
    from fastsched.engine.core import EngineCore
    from fastsched.engine.step_trace import StepTracer
    from fastsched.tools.simulator.cost import fit_step_cost, read_step_trace

    if args.repeats < 1 or args.decode_context < 1:
        raise ValueError("--repeats and --decode-context must be at least 1")
    core = EngineCore(EngineConfig.from_kwargs(**{**engine_kwargs(args), "step_trace": None}))
    sc = core.scheduler.config
    usable_tokens = (sc.num_gpu_blocks - 1) * sc.block_size
    per_decode = args.decode_context + args.repeats + 1
    if per_decode >= core.max_model_len:
        raise ValueError(
            f"--decode-context ({args.decode_context}) + --repeats ({args.repeats}) must be below "
            f"max_model_len ({core.max_model_len})"
        )
    max_batch = min(args.max_batch or sc.max_num_seqs, sc.max_num_seqs, usable_tokens // (2 * per_decode))
    max_prefill = min(
        args.max_prefill or sc.max_num_batched_tokens, sc.max_num_batched_tokens, core.max_model_len - 2
    )
    if max_batch < 1:
        raise ValueError(
            f"the KV pool ({usable_tokens} tokens) cannot hold one decoding request of "
            f"{per_decode} tokens with room to spare; lower --decode-context"
        )
    shapes = sweep_shapes(max_batch, max_prefill, sc.max_num_batched_tokens)
    bench = _SweepRunner(core, args.decode_context, args.repeats)
    bench.run(Shape(1, min(MIN_PREFILL, max_prefill)))  # warm-up, not recorded
    with tempfile.TemporaryDirectory() as tmp:
        path = args.step_trace or os.path.join(tmp, "steps.jsonl")
        core.step_tracer = StepTracer(path)
        for shape in tqdm(
            shapes, desc="step shapes", unit="shape", disable=args.no_progress, file=sys.stderr
        ):
            bench.run(shape)
        core.step_tracer.close()
        fit = fit_step_cost(read_step_trace([path]), source=f"fastsched bench steps ({len(shapes)} shapes)")
    _report(fit, args.out)
    return 0


class _SweepRunner:
    """Holds one shape on an idle engine: the decoders' prefill, then ``repeats`` steps."""

    def __init__(self, core: EngineCore, decode_context: int, repeats: int) -> None:
        self.core = core
        self.decode_context = decode_context
        self.repeats = repeats
        self.rng = random.Random(0)
        self.next_id = 0
        self.hi_id = min(TOKEN_ID_RANGE[1], core.vocab_size)

    def run(self, shape: Shape) -> None:
        core = self.core
        for _ in range(shape.decodes):
            # One token from the prefill step, then one per repeat: they all end with the last repeat.
            self.add(self.decode_context, self.repeats + 1)
        while core.scheduler.num_waiting or self._prefilling():
            core.step()
        for _ in range(self.repeats):
            if shape.prefill:
                self.add(shape.prefill, 1)
            core.step()
        while core.has_unfinished_requests():
            core.step()

    def add(self, prompt_len: int, max_tokens: int) -> None:
        from fastsched.engine.protocol import EngineCoreRequest
        from fastsched.sampling_params import SamplingParams

        prompt = [self.rng.randrange(TOKEN_ID_RANGE[0], self.hi_id) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.add_request(EngineCoreRequest(f"bench-steps-{self.next_id}", prompt, params))
        self.next_id += 1

    def _prefilling(self) -> bool:
        sched = self.core.scheduler
        return any(sched.request_info(h)["num_output_tokens"] == 0 for h in sched.running_handles())
