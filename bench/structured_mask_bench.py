"""Per-step cost of structured outputs: filling the token bitmask of N constrained rows
(llguidance, in parallel) and applying it to a batch of logits, on the embedded SmolLM2's
vocabulary. Each row follows a random walk through a nested JSON schema (tokens sampled
from what its mask allows), so masks are measured at realistic grammar states.

    python bench/structured_mask_bench.py --rows 64 256 --steps 60

``--engine xgrammar`` measures the same walk with xgrammar instead (its batched matcher and
its own CPU mask application), for choosing between the two grammar engines; xgrammar is
not a dependency of fastsched, so install it first (``pip install xgrammar``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from fastsched.model_loader import load_tokenizer
from fastsched.structured.bitmask import apply_token_bitmask
from fastsched.structured.matchers import StructuredOutputManager
from fastsched.structured.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["person", "company", "place"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "address"],
    "additionalProperties": False,
}


def run(rows: int, steps: int, seed: int) -> dict[str, float]:
    """llguidance, as the engine drives it (fastsched.structured)."""
    tokenizer = load_tokenizer(None)
    vocab = tokenizer.vocab_size
    manager = StructuredOutputManager(tokenizer.backend.to_str(), vocab, tokenizer.eos_token_ids)
    grammar = StructuredOutputsParams(json=SCHEMA).grammar_text()
    keys = list(range(rows))
    for key in keys:
        manager.add(key, grammar)
    logits = torch.zeros(rows, vocab)
    all_rows = np.arange(rows)
    fill_us, apply_us = [], []
    for _ in tqdm(range(steps), desc=f"{rows} rows", unit="step"):
        live = [k for k in keys if not manager.is_finished(k)]
        if not live:
            break
        start = time.perf_counter()
        mask = manager.fill_bitmask(live)
        filled = time.perf_counter()
        logits.normal_()
        before_apply = time.perf_counter()
        apply_token_bitmask(logits[: len(live)], mask, all_rows[: len(live)])
        fill_us.append((filled - start) * 1e6)
        apply_us.append((time.perf_counter() - before_apply) * 1e6)
        # Sample among the allowed tokens (the argmax of masked random logits), and advance.
        tokens = logits[: len(live)].argmax(dim=1).tolist()
        for key, token in zip(live, tokens):
            if token in tokenizer.eos_token_ids:
                manager.remove(key)
                keys.remove(key)
            else:
                manager.accept(key, [token])
    return _summary(rows, fill_us, apply_us)


def run_xgrammar(rows: int, steps: int, seed: int) -> dict[str, float]:
    """The same random walk with xgrammar: one compiled schema, a matcher per row, the batched
    fill (its thread pool) and ``apply_token_bitmask_inplace`` on the CPU."""
    import transformers
    import xgrammar as xgr

    tokenizer = load_tokenizer(None)
    vocab = tokenizer.vocab_size
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgr.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=vocab, stop_token_ids=list(tokenizer.eos_token_ids)
    )
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    batch = xgr.BatchGrammarMatcher()
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    logits = torch.zeros(rows, vocab)
    fill_us, apply_us = [], []
    for _ in tqdm(range(steps), desc=f"{rows} rows (xgrammar)", unit="step"):
        matchers = [m for m in matchers if not m.is_terminated()]
        if not matchers:
            break
        n = len(matchers)
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask[:n])
        filled = time.perf_counter()
        logits.normal_()
        before_apply = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits[:n], bitmask[:n])
        fill_us.append((filled - start) * 1e6)
        apply_us.append((time.perf_counter() - before_apply) * 1e6)
        for matcher, token in zip(matchers, logits[:n].argmax(dim=1).tolist()):
            matcher.accept_token(token)
    return _summary(rows, fill_us, apply_us)


def _summary(rows: int, fill_us: list[float], apply_us: list[float]) -> dict[str, float]:
    return {
        "rows": rows,
        "steps": len(fill_us),
        "fill_us_median": statistics.median(fill_us),
        "fill_us_p90": float(np.quantile(fill_us, 0.9)),
        "apply_us_median": statistics.median(apply_us),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[64, 256], help="constrained requests per step"
    )
    parser.add_argument("--steps", type=int, default=60, help="steps measured per row count")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random walks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the mask application)")
    parser.add_argument(
        "--engine",
        choices=["llguidance", "xgrammar"],
        default="llguidance",
        help="grammar engine (xgrammar: not a dependency, install it to compare)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| rows | steps | mask fill median µs | fill p90 µs | apply median µs |")
    print("| --- | --- | --- | --- | --- |")
    measure = run_xgrammar if args.engine == "xgrammar" else run
    results = [measure(rows, args.steps, args.seed) for rows in args.rows]
    for r in results:
        print(
            f"| {r['rows']} | {r['steps']} | {r['fill_us_median']:.0f} | {r['fill_us_p90']:.0f} | "
            f"{r['apply_us_median']:.0f} |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
