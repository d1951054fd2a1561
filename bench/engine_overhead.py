"""Host overhead of the engine loop: what one ``EngineCore.step()`` costs besides the forward pass.

The forward pass is replaced by a null model (``--fake-forward-ms X``, see ``NullModel``): a
forward call returns at once, like a GPU launch, and the host waits, GIL released, when it
reads the step's results until a simulated device has spent X ms on the pass; logits are read
from a fixed random table (indexed by the last token and its position), so sampling still
runs on real tensors and greedy decoding is deterministic. The load is
``--running`` requests of ``--prompt-len`` random tokens, all added at once and all in
flight; every request ignores EOS, so nothing finishes before ``--output-len`` tokens.
After the prefill (however many steps the token budget needs) and ``--warmup`` decode
steps, ``--steps`` steps are timed.

Per step the bench reports (medians, µs):

- ``step``: the wall time of one ``step()`` plus encoding its OUTPUTS message, i.e. the
  period of an engine loop that is never idle;
- ``host``: ``step`` minus the model's time (waiting for the simulated device, and the logits
  lookup): without async scheduling everything the host does per step; with it, what the
  host does while the device is *not* busy (the waits overlap the next step's host work);
- ``forward``: that model time;
- the split: ``schedule`` (``Scheduler.schedule``), ``prepare_inputs`` (the runner's input
  arrays and tensors), ``sample`` (sampling metadata and the sampler), ``update``
  (``Scheduler.update_from_*``), ``collect`` (the step's outputs), ``output`` (encoding the
  OUTPUTS message an engine process sends), ``structured`` (``--sampling structured``: advancing
  the matchers and filling the token bitmasks; applying a mask to the logits, just before
  sampling, is left in ``other``). What the split leaves out (bookkeeping of the
  step itself, statistics, the prefill meter) is ``other``. With async scheduling the
  sampler runs on the forward thread, overlapping the rest, so ``other`` can be negative.

The same load then runs on the real tiny model (``fastsched.tools.tiny_model``) unless
``--no-real-model``; there ``forward`` is the measured model time. ``--llm-generate`` also
times ``LLM.generate`` over the same requests with the null model (tokens per second of
the whole call, output processing included).

The table goes to stdout and the last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

FIRST_PROMPT_TOKEN = 3  # the tiny model's ids below this are special tokens
LOGITS_TABLE_ROWS = 257
PHASES = ("schedule", "prepare_inputs", "sample", "update", "collect", "output", "structured")


class NullModel:
    """Stands in for the model on a device that takes ``forward_ms`` per forward pass.

    ``forward`` returns at once, like a GPU launch: it books the pass on a simulated
    device clock (a pass starts when it is issued or when the previous one ends, whichever
    is later) and returns a cheap per-token key. The host waits for the device when it
    reads the step's results (``wait``, installed around ``ModelRunner.fetch``), sleeping
    with the GIL released until the pass ends. ``compute_logits`` reads fixed random logits
    rows by the key. A late wake-up therefore does not delay the passes queued behind it,
    as on a real device. A plain class, not a ``torch.nn.Module``, whose attribute writes
    cost microseconds."""

    def __init__(self, config: Any, forward_ms: float, seed: int = 0) -> None:
        self.config = config
        self.forward_s = forward_ms / 1000
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.randn(LOGITS_TABLE_ROWS, config.vocab_size, generator=generator) * 4
        self.model_seconds = 0.0  # waits for the device, keys and logits lookups since the last reset
        self._device_free_at = 0.0
        self._ends: deque[float] = deque()  # end of each pass issued and not yet waited for

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, *args: Any) -> torch.Tensor:
        start = time.perf_counter()
        end = max(start, self._device_free_at) + self.forward_s
        self._device_free_at = end
        self._ends.append(end)
        key = ((input_ids * 1009 + positions) % LOGITS_TABLE_ROWS).unsqueeze(1)
        self.model_seconds += time.perf_counter() - start
        return key

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.table.index_select(0, hidden[:, 0])
        self.model_seconds += time.perf_counter() - start
        return logits

    def wait(self) -> None:
        """The host needs the oldest pass's results: sleep until the device is done with it."""
        start = time.perf_counter()
        delay = self._ends.popleft() - start
        if delay > 0:
            time.sleep(delay)
        self.model_seconds += time.perf_counter() - start


class TimedModel:
    """Wraps the real model to measure its time (forward and logits), as NullModel does."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = model
        self.config = model.config
        self.model_seconds = 0.0

    def __call__(self, *args: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner(*args)
        self.model_seconds += time.perf_counter() - start
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.compute_logits(hidden)
        self.model_seconds += time.perf_counter() - start
        return out


class PhaseTimer:
    """Seconds per phase, accumulated over one step by the wrappers ``wrap`` installs."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        return timed

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


class _TimedScheduler:
    """The scheduler with ``schedule`` and ``update_from_*`` timed (the binding's methods cannot be patched)."""

    def __init__(self, inner: Any, timer: PhaseTimer) -> None:
        self._inner = inner
        self.schedule = timer.wrap("schedule", inner.schedule)
        self.update_from_tokens = timer.wrap("update", inner.update_from_tokens)
        self.update_from_output = timer.wrap("update", inner.update_from_output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def instrument(core: Any, timer: PhaseTimer) -> Iterator[Callable[[], float]]:
    """Installs the phase timers on ``core``; gives a function returning the model time of the last step."""
    core.scheduler = _TimedScheduler(core.scheduler, timer)
    runner = core.runner
    runner.prepare = timer.wrap("prepare", runner.prepare)
    sampling = runner.batch.sampling
    sampling.gather = timer.wrap("gather", sampling.gather)
    runner.sampler = timer.wrap("sample", runner.sampler)
    runner.write_sampled = timer.wrap("update", runner.write_sampled)
    model = runner.model
    if isinstance(model, NullModel):
        fetch = runner.fetch

        def waiting_fetch(executed: Any) -> Any:
            if executed.step.num_reqs:
                model.wait()
            return fetch(executed)

        runner.fetch = waiting_fetch
    core._outputs.collect = timer.wrap("collect", core._outputs.collect)
    structured = core.structured
    structured.advance = timer.wrap("structured", structured.advance)
    structured.step_bitmask = timer.wrap("structured", structured.step_bitmask)

    def model_time() -> float:
        seconds, model.model_seconds = model.model_seconds, 0.0
        return seconds

    yield model_time


def sampling_params(kind: str, max_tokens: int) -> Any:
    from fastsched import SamplingParams

    common: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True}
    if kind == "greedy":
        return SamplingParams(temperature=0, **common)
    if kind == "random":
        return SamplingParams(temperature=1.0, top_p=0.9, **common)
    if kind == "penalties":
        return SamplingParams(temperature=0, repetition_penalty=1.1, presence_penalty=0.5, **common)
    if kind == "logprobs":
        return SamplingParams(temperature=0, logprobs=5, **common)
    if kind == "structured":
        # A JSON array of at least 1000 strings: no request completes it (and ends) within the bench.
        schema = {"type": "array", "items": {"type": "string"}, "minItems": 1000}
        return SamplingParams(temperature=0, structured_outputs={"json": schema}, **common)
    raise ValueError(kind)


def engine_kwargs(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    max_model_len = args.prompt_len + args.output_len
    blocks_per_request = -(-max_model_len // 16)
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        device="cpu",
        dtype="float32",
        max_num_seqs=args.running,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.running),
        max_model_len=max_model_len,
        num_gpu_blocks=args.running * blocks_per_request + 1,
        enable_prefix_caching=False,
        log_stats_interval=0,
    )
    if args.async_scheduling is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    return kwargs


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    return rng.integers(FIRST_PROMPT_TOKEN, vocab_size, size=(args.running, args.prompt_len)).tolist()


def run_engine(args: argparse.Namespace, model_dir: str, null_model: bool) -> dict[str, Any]:
    """Times ``--steps`` decode steps of ``--running`` requests; returns the medians and the samples."""
    from fastsched.config import EngineConfig
    from fastsched.engine.core import EngineCore

    core = EngineCore(EngineConfig.from_kwargs(**engine_kwargs(args, model_dir)))
    runner = core.runner
    runner.model = (
        NullModel(runner.model.config, args.fake_forward_ms) if null_model else TimedModel(runner.model)
    )
    timer = PhaseTimer()
    with instrument(core, timer) as model_time:
        return _time_steps(args, core, timer, model_time)


def _time_steps(
    args: argparse.Namespace, core: Any, timer: PhaseTimer, model_time: Callable[[], float]
) -> dict[str, Any]:
    from fastsched.engine import protocol
    from fastsched.engine.protocol import EngineCoreRequest, EngineStats

    params = sampling_params(args.sampling, args.output_len)
    for i, prompt in enumerate(make_prompts(args, core.vocab_size)):
        core.add_request(EngineCoreRequest(str(i), prompt, params))
    stats = EngineStats()

    def one_step() -> tuple[float, float, int]:
        start = time.perf_counter()
        outputs = core.step()
        with timer.measure("output"):
            protocol.encode(protocol.Outputs(0, outputs, stats))
        return time.perf_counter() - start, model_time(), len(outputs.token_ids)

    # Prefill (as many steps as the token budget needs), then --warmup decode steps.
    prefill_steps = 0
    while core.scheduler.num_running < args.running or core.scheduler.num_waiting:
        one_step()
        prefill_steps += 1
    for _ in range(args.warmup):
        one_step()
    timer.take()
    samples: dict[str, list[float]] = defaultdict(list)
    tokens = 0
    profiler = cProfile.Profile() if args.profile and isinstance(core.runner.model, NullModel) else None
    if profiler is not None:
        profiler.enable()
    begin = time.perf_counter()
    for _ in range(args.steps):
        wall, model_s, produced = one_step()
        split = timer.take()
        split["sample"] = split.get("sample", 0.0) + split.get("gather", 0.0)
        tokens += produced
        samples["step"].append(wall)
        samples["forward"].append(model_s)
        samples["host"].append(wall - model_s)
        # prepare() includes gathering the sampling metadata, counted under sample.
        split["prepare_inputs"] = split.pop("prepare", 0.0) - split.pop("gather", 0.0)
        for phase in PHASES:
            samples[phase].append(split.get(phase, 0.0))
        samples["other"].append(wall - model_s - sum(split.get(p, 0.0) for p in PHASES))
    elapsed = time.perf_counter() - begin
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(args.profile_sort).print_stats(args.profile)
        print(text.getvalue(), file=sys.stderr)
    result = {f"{name}_us_median": round(1e6 * statistics.median(v), 1) for name, v in samples.items()}
    result["host_us_p99"] = round(1e6 * float(np.percentile(samples["host"], 99)), 1)
    result["steps_per_s"] = round(args.steps / elapsed, 1)
    result["tokens_per_s"] = round(tokens / elapsed, 1)
    result["prefill_steps"] = prefill_steps
    result["num_running"] = core.scheduler.num_running
    return result


def run_llm_generate(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """``LLM.generate`` over ``--running`` requests with the null model: output tokens per second."""
    from fastsched import LLM

    kwargs = engine_kwargs(args, model_dir)
    llm = LLM(**kwargs)
    runner = llm.engine.runner
    runner.model = NullModel(runner.model.config, args.fake_forward_ms)
    with instrument(llm.engine, PhaseTimer()):
        return _time_generate(args, llm)


def _time_generate(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    prompts = make_prompts(args, llm.engine.vocab_size)
    params = sampling_params(args.sampling, args.output_len)
    llm.generate(prompts[:4], sampling_params(args.sampling, 4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=256, help="requests in flight")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="tokens per request (default: enough that none finishes while timed)",
    )
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed")
    parser.add_argument("--warmup", type=int, default=20, help="decode steps run before timing")
    parser.add_argument("--fake-forward-ms", type=float, default=0.0, help="the null model's forward pass")
    parser.add_argument(
        "--sampling", choices=("greedy", "random", "penalties", "logprobs", "structured"), default="greedy"
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while step N's forward pass runs (default: the engine's)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=1024,
        help="the tiny model's vocabulary, i.e. the width of every step's logits (SmolLM2's: 49152)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-real-model", action="store_true", help="skip the run on the real tiny model")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="cProfile the timed null-model steps; print the top N functions by own time to stderr",
    )
    parser.add_argument("--profile-sort", default="tottime", help="pstats sort key for --profile")
    parser.add_argument(
        "--llm-generate", action="store_true", help="also time LLM.generate with the null model"
    )
    args = parser.parse_args(argv)
    if args.output_len is None:
        # Prefill steps (at most one per budget's worth of prompt tokens) + warm-up + timed + 1.
        prefill = -(-args.running * args.prompt_len // max(args.max_num_batched_tokens, args.running))
        args.output_len = prefill + args.warmup + args.steps + 2
    return args


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    columns = ("step", "host", "forward", *PHASES, "other")
    print("| run | " + " | ".join(f"{c} µs" for c in columns) + " | host p99 µs | steps/s | tokens/s |")
    print("| --- |" + " ---: |" * (len(columns) + 3))
    for name, r in rows.items():
        cells = [f"{r[f'{c}_us_median']:.1f}" for c in columns]
        print(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {r['host_us_p99']:.1f} | {r['steps_per_s']} | {r['tokens_per_s']} |"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from fastsched.tools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="fastsched-overhead-") as tmp:
        model_dir = str(make_tiny_model(Path(tmp) / "tiny", vocab_size=args.vocab_size))
        rows = {
            f"null model, forward {args.fake_forward_ms:g} ms": run_engine(args, model_dir, null_model=True)
        }
        if not args.no_real_model:
            rows["real tiny model"] = run_engine(args, model_dir, null_model=False)
        generate = run_llm_generate(args, model_dir) if args.llm_generate else None
    print(
        f"{args.running} running, prompt {args.prompt_len}, output {args.output_len}, {args.sampling}, "
        f"{args.steps} timed steps after {args.warmup} warm-up, async scheduling: "
        f"{'engine default' if args.async_scheduling is None else args.async_scheduling}, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    print_table(rows)
    if generate is not None:
        print(
            f"LLM.generate, null model: {generate['tokens']} tokens in {generate['seconds']} s = "
            f"{generate['tokens_per_s']} tokens/s"
        )
    null = next(iter(rows.values()))
    summary: dict[str, Any] = {
        "running": args.running,
        "fake_forward_ms": args.fake_forward_ms,
        "sampling": args.sampling,
        "host_us_median": null["host_us_median"],
        "host_us_p99": null["host_us_p99"],
        "step_us_median": null["step_us_median"],
        "steps_per_s": null["steps_per_s"],
        "tokens_per_s": null["tokens_per_s"],
        **{f"{phase}_us": null[f"{phase}_us_median"] for phase in (*PHASES, "other")},
    }
    if "real tiny model" in rows:
        real = rows["real tiny model"]
        summary["real_model"] = {
            k: real[k]
            for k in ("step_us_median", "host_us_median", "forward_us_median", "host_us_p99", "tokens_per_s")
        }
    if generate is not None:
        summary["llm_generate_tokens_per_s"] = generate["tokens_per_s"]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
