"""Tensor parallelism's cost per engine step on the tiny model (issue 24): TP=1 vs TP=2
(gloo, fp32, CPU), in one run, alternating.

``--running`` requests with 32-token random prompts decode greedily (EOS ignored), all in
flight, synchronous loop (so that the host's part of a step is the step minus the model).
After the prefill and ``--warmup`` steps, ``--steps`` decode steps are timed:

- step: ``EngineCore.step()``;
- model: the model's forward and logits on rank 0, its collectives (all-reduces, the logits
  gather) included: what a device would run;
- host: step minus model; the row "TP adds" is host(TP=2) minus host(TP=1);
- send: the step-input broadcast (``StepChannel.send``), part of host;
- bytes per step: the step inputs broadcast (measured), the all-reduces (2 per layer plus
  the embedding, ``T x hidden`` each) and the logits gathered to rank 0 (computed).

    .venv/bin/python bench/tp_step_bench.py --running 256 --rounds 3
    .venv/bin/python bench/tp_step_bench.py --running 256 --rounds 3 --lora 2

``--lora K``: K random rank-8 adapters (``make_tiny_lora``, every projection), the requests
taking the base model and the adapters in turn; the step inputs then carry rank 0's LoRA
plan (a few int64 per token) and every rank adds its slices' deltas.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fastsched.config import EngineConfig
from fastsched.engine.core import EngineCore
from fastsched.engine.protocol import EngineCoreRequest
from fastsched.lora import LoRARequest
from fastsched.sampling_params import SamplingParams
from fastsched.tools.tiny_lora import make_tiny_lora
from fastsched.tools.tiny_model import make_tiny_model


class Timed:
    """Accumulates the seconds spent in ``fn``."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - start


def run(
    model: Path, tp: int, running: int, warmup: int, steps: int, adapters: list[LoRARequest]
) -> dict[str, float]:
    lora = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=8) if adapters else {}
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        tensor_parallel_size=tp,
        num_threads=1,
        async_scheduling=False,
        num_gpu_blocks=running * 8 + 1,
        max_num_seqs=running,
        max_num_batched_tokens=max(2048, running * 32),
        log_stats_interval=0,
        max_model_len=512,
        **lora,
    )
    core = EngineCore(config)
    try:
        inner = core.runner.model
        forward, logits = Timed(inner.forward), Timed(inner.compute_logits)
        inner.forward, inner.compute_logits = forward, logits  # instance attributes shadow the methods
        channel = core.runner.step_channel
        send = None
        if channel is not None:
            send = Timed(channel.send)
            channel.send = send
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=warmup + steps + 8, ignore_eos=True)
        for i in range(running):
            prompt = [rng.randrange(3, core.vocab_size) for _ in range(32)]
            adapter = ([None, *adapters])[i % (len(adapters) + 1)]
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params, time.time(), lora_request=adapter))
        for _ in range(warmup + 1):  # the prefill, then warm-up decodes
            core.step()
        step_s, model_s, send_s = [], [], []
        bytes_before = 0 if channel is None else channel.bytes_sent
        for _ in range(steps):
            f0, l0, s0 = forward.seconds, logits.seconds, 0.0 if send is None else send.seconds
            start = time.perf_counter()
            core.step()
            step_s.append(time.perf_counter() - start)
            model_s.append(forward.seconds - f0 + logits.seconds - l0)
            send_s.append(0.0 if send is None else send.seconds - s0)
        cfg = core.model_config
        input_bytes = 0.0 if channel is None else (channel.bytes_sent - bytes_before) / steps
        elem = 4
        allreduce = (2 * cfg.num_layers + 1) * running * cfg.hidden_size * elem if tp > 1 else 0
        gather = running * -(-cfg.vocab_size // tp) * elem * (tp - 1)
        host = [s - m for s, m in zip(step_s, model_s, strict=True)]
        return {
            "step": statistics.median(step_s),
            "model": statistics.median(model_s),
            "host": statistics.median(host),
            "send": statistics.median(send_s),
            "input_bytes": input_bytes,
            "allreduce_bytes": allreduce,
            "gather_bytes": gather,
        }
    finally:
        core.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="TP=1 and TP=2 alternate this many times")
    parser.add_argument(
        "--lora", type=int, default=0, help="adapters the requests use in turn with the base model"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny")
        adapters = [
            LoRARequest(f"lora{k}", k, str(make_tiny_lora(model, Path(tmp) / f"lora{k}", rank=8, seed=k)))
            for k in range(1, args.lora + 1)
        ]
        results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
        for _ in range(args.rounds):
            for tp in (1, 2):
                results[tp].append(run(model, tp, args.running, args.warmup, args.steps, adapters))
    print(
        f"running={args.running}, {args.steps} decode steps after {args.warmup} warm-up, {args.rounds} rounds "
        f"(median of the rounds' medians), {args.lora} LoRA adapters, µs"
    )
    print("| TP | step | model | host | send | input bytes | all-reduce bytes | gather bytes |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    med = {tp: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for tp, rs in results.items()}
    for tp, m in med.items():
        print(
            f"| {tp} | {m['step'] * 1e6:.0f} | {m['model'] * 1e6:.0f} | {m['host'] * 1e6:.0f} | "
            f"{m['send'] * 1e6:.0f} | {m['input_bytes']:.0f} | {m['allreduce_bytes']:.0f} | {m['gather_bytes']:.0f} |"
        )
    print(
        f"TP adds to host per step: {(med[2]['host'] - med[1]['host']) * 1e6:.0f} µs "
        f"(rounds: {[round((b['host'] - a['host']) * 1e6) for a, b in zip(results[1], results[2], strict=True)]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
