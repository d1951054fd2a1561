"""Speculative decoding on a repetitive workload: accepted tokens per step and end-to-end
tokens/s, with and without drafts.

The workload asks the model to repeat a given paragraph or piece of code (SmolLM2's chat
template; the request ends at EOS or ``--max-tokens``), which is where n-gram prompt lookup
finds its drafts. The tiny random model gets raw token ids, prompts that repeat a random
phrase, and ignores EOS. Every request is greedy, so each configuration produces the same
tokens (checked) and only the time differs.

    PYTHONPATH=python python bench/spec_decode_bench.py --model default --num-requests 1 --max-tokens 256 --repeat 3
    PYTHONPATH=python python bench/spec_decode_bench.py --model tiny --num-requests 16 --max-tokens 128 --repeat 3

Each configuration keeps its engine; the timed runs go round the configurations ``--repeat``
times (so a burst of load on a shared machine hits them alike) and the median is reported.
Without drafts the engine runs with async scheduling (the default) and without it (the loop
speculation runs); with drafts it cannot overlap.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fastsched import LLM, SamplingParams
from fastsched.tools.tiny_model import make_tiny_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill. "
    "Outside, the rain falls softly on the garden, and the old oak tree sways in the wind. "
    "Inside the house, a kettle whistles in the kitchen and someone laughs in the next room. "
    "The afternoon passes slowly, as afternoons do when nobody is in a hurry to be anywhere.",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    if b == 0:\n"
    "        raise ZeroDivisionError('b must not be zero')\n    return a / b\n",
]


def prompts_for(llm: LLM, model: str, n: int) -> list:
    if model == "tiny":
        rng = random.Random(0)
        vocab = llm.engine.vocab_size
        return [[rng.randrange(3, vocab) for _ in range(12)] * 6 for _ in range(n)]
    conversations = [
        [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXTS[i % len(TEXTS)]}"}]
        for i in range(n)
    ]
    return [
        llm.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in conversations
    ]


def timed_run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, int, list[list[int]]]:
    """(seconds, engine steps, output tokens) of one generate call over every prompt."""
    steps_before = llm.engine.scheduler.stats()["num_steps"]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return (
        elapsed,
        llm.engine.scheduler.stats()["num_steps"] - steps_before,
        [o.outputs[0].token_ids for o in outputs],
    )


def summary(
    spec: dict | None, llm: LLM, times: list[float], steps: int, outputs: list[list[int]], repeat: int
) -> dict:
    tokens = sum(len(t) for t in outputs)
    seconds = statistics.median(times)
    loop = "sync" if spec or not llm.config.async_scheduling else "async"
    row = {
        "spec": spec.get("method", "draft_model") if spec else f"none ({loop})",
        "k": spec["num_speculative_tokens"] if spec else 0,
        "tokens": tokens,
        "steps": steps,
        "tokens_per_step": round(tokens / steps, 2),
        "median_s": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "runs_s": [round(t, 2) for t in times],
    }
    c = llm.engine.spec_counters
    if c is not None:  # summed over the repeats; the warm-up's few drafts included
        row.update(
            acceptance_rate=round(c.acceptance_rate, 3),
            mean_acceptance_length=round(1 + c.num_accepted_tokens / max(c.num_drafts, 1), 2),
            accepted_per_pos=[round(n / repeat) for n in c.num_accepted_tokens_per_pos],
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed runs per configuration (median reported)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = None
    if args.model == "tiny":
        model_path = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    specs = [None, None] + [
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        for k in args.k
    ]
    if args.model == "tiny":
        specs.append({"model": model_path, "num_speculative_tokens": args.k[-1]})
    # Without drafts: the default loop (async scheduling) and the synchronous one that speculation uses.
    llms = [
        LLM(model=model_path, log_stats_interval=0, speculative_config=spec, async_scheduling=i != 1)
        for i, spec in enumerate(specs)
    ]
    prompts = prompts_for(llms[0], args.model, args.num_requests)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.model == "tiny")
    for llm in llms:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    times: list[list[float]] = [[] for _ in specs]
    results: list[tuple[int, list[list[int]]]] = []
    for _ in range(args.repeat):
        results = []
        for i, llm in enumerate(llms):
            elapsed, steps, outputs = timed_run(llm, prompts, params)
            times[i].append(elapsed)
            results.append((steps, outputs))
    baseline = results[0][1]
    if any(outputs != baseline for _, outputs in results):
        raise SystemExit("greedy outputs differ from the run without drafts")
    rows = [
        summary(spec, llm, t, steps, outputs, args.repeat)
        for spec, llm, t, (steps, outputs) in zip(specs, llms, times, results)
    ]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
