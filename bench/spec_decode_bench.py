"""Speculative decoding on a repetitive workload: accepted tokens per step and end-to-end
tokens/s, with and without drafts.

The workload asks the model to repeat a given paragraph or piece of code (SmolLM2's chat
template; the request ends at EOS or ``--max-tokens``), which is where n-gram prompt lookup
finds its drafts. The tiny random model gets raw token ids, prompts that repeat a random
phrase, and ignores EOS. Every request is greedy, so each configuration produces the same
tokens (checked) and only the time differs.

    PYTHONPATH=python python bench/spec_decode_bench.py --model default --num-requests 8 --max-tokens 96
    PYTHONPATH=python python bench/spec_decode_bench.py --model tiny --num-requests 16 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import random
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
    conversations = [[{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXTS[i % len(TEXTS)]}"}]
                     for i in range(n)]
    return [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in conversations]


def run(model_path: str | None, spec: dict | None, model: str, num_requests: int, max_tokens: int) -> dict:
    llm = LLM(model=model_path, log_stats_interval=0, speculative_config=spec, async_scheduling=spec is None)
    prompts = prompts_for(llm, model, num_requests)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=model == "tiny")
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    steps_before = llm.engine.scheduler.stats()["num_steps"]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = {"spec": spec.get("method", "draft_model") if spec else "none", "k": spec["num_speculative_tokens"] if spec else 0,
           "tokens": tokens, "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / elapsed, 1),
           "steps": llm.engine.scheduler.stats()["num_steps"] - steps_before,
           "outputs": [o.outputs[0].token_ids for o in outputs]}
    c = llm.engine.spec_counters
    if c is not None:
        row.update(acceptance_rate=round(c.acceptance_rate, 3),
                   accepted_per_draft=round(c.num_accepted_tokens / max(c.num_drafts, 1), 2),
                   accepted_per_pos=c.num_accepted_tokens_per_pos)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = None
    if args.model == "tiny":
        model_path = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    specs = [None] + [{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 4} for k in args.k]
    if args.model == "tiny":
        specs.append({"model": model_path, "num_speculative_tokens": args.k[-1]})
    rows = [run(model_path, spec, args.model, args.num_requests, args.max_tokens) for spec in specs]
    baseline = rows[0]["outputs"]
    for row in rows:
        if row.pop("outputs") != baseline:
            raise SystemExit(f"greedy outputs differ from the run without drafts: {row}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
