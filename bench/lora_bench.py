"""Multi-LoRA throughput: the same requests with 0, 1, 4 and 16 distinct adapters.

The workload is ``--num-prompts`` requests with random token-id prompts of
``--prompt-len`` tokens, each generating ``--output-len`` tokens (greedy, EOS ignored),
run by one ``LLM.generate`` call. With ``n`` adapters request ``i`` uses adapter
``i % n``; ``n = 0`` is the base model with LoRA off (the reference). Every adapter is a
random one of ``fastsched make-tiny-lora`` (``--rank``, all seven projections), and the
engine gets ``max_loras = n`` (so no request waits for a slot) unless ``--max-loras``
caps it, which shows the S7 skip's cost.

Each configuration builds its engine once and runs the workload once to warm up
(adapters read, slots filled); then ``--repeats`` rounds run every configuration in
turn. Figures: each one's median output tokens per wall-clock second, the median over
rounds of its ratio to no LoRA in the same round, and its median output tokens per second
of the process's CPU time (all threads), which a busy shared machine disturbs less.
``--model`` defaults to the tiny random-weight Llama written to a temporary directory.
The table goes to stdout, the last line one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from fastsched import LLM, SamplingParams
from fastsched.lora import LoRARequest
from fastsched.tools.tiny_lora import make_tiny_lora
from fastsched.tools.tiny_model import make_tiny_model


class Config:
    """One engine with ``n`` adapters (request ``i`` uses adapter ``i % n``)."""

    def __init__(
        self, model: str, adapters: list[LoRARequest], max_loras: int, args: argparse.Namespace
    ) -> None:
        lora_args = (
            dict(
                enable_lora=True,
                max_loras=max_loras,
                max_lora_rank=args.rank,
                max_cpu_loras=max(len(adapters), max_loras),
            )
            if adapters
            else {}
        )
        self.llm = LLM(
            model,
            kv_cache_memory=256 * 1024**2,
            max_model_len=args.prompt_len + args.output_len + 16,
            log_stats_interval=0.0,
            **lora_args,
        )
        self.loras = [adapters[i % len(adapters)] for i in range(args.num_prompts)] if adapters else None
        self.rates: list[float] = []  # output tokens per wall-clock second
        self.cpu_rates: list[float] = []  # output tokens per second of this process's CPU time

    def run(self, prompts: list[list[int]], params: SamplingParams) -> None:
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = self.llm.generate(prompts, params, lora_request=self.loras, use_tqdm=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        self.rates.append(tokens / wall)
        self.cpu_rates.append(tokens / cpu)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF directory (default: the tiny model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument(
        "--max-loras", type=int, default=None, help="cap max_loras (default: the adapter count)"
    )
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model(Path(tmp) / "model"))
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        configs = {}
        for n in args.adapters:
            adapters = [
                LoRARequest(
                    f"a{i}", i + 1, str(make_tiny_lora(model, Path(tmp) / f"a{i}", rank=args.rank, seed=i))
                )
                for i in range(n)
            ]
            configs[n] = Config(model, adapters, min(n, args.max_loras or n), args)
            configs[n].run(prompts, params)  # warm-up: adapters read, slots filled
            configs[n].rates.clear()
            configs[n].cpu_rates.clear()
        # Rounds over all configurations, so that a change in the machine's load hits them alike.
        for _ in range(args.repeats):
            for config in configs.values():
                config.run(prompts, params)
        figures = {n: statistics.median(c.rates) for n, c in configs.items()}
        cpu_figures = {n: statistics.median(c.cpu_rates) for n, c in configs.items()}
        base = configs.get(0)
        print(
            "| adapters | max_loras | tokens/s (wall) | runs | vs no LoRA, per round | tokens per CPU-second "
            "| vs no LoRA |"
        )
        print("| ---: | ---: | ---: | --- | ---: | ---: | ---: |")
        for n, config in configs.items():
            runs = "/".join(f"{r:.0f}" for r in config.rates)
            max_loras = min(n, args.max_loras or n) if n else "—"
            share = cpu_share = "—"
            if base is not None:
                # The median of the rounds' ratios: a round's configurations ran under a similar load.
                share = f"{100 * statistics.median(r / b for r, b in zip(config.rates, base.rates)):.0f} %"
                cpu_share = f"{100 * cpu_figures[n] / cpu_figures[0]:.0f} %"
            print(
                f"| {n} | {max_loras} | {figures[n]:.0f} | {runs} | {share} | {cpu_figures[n]:.0f} | {cpu_share} |"
            )
        print(json.dumps({"tokens_per_s": figures, "tokens_per_cpu_s": cpu_figures, **vars(args)}))


if __name__ == "__main__":
    main()
