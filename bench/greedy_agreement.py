"""How closely a quantized GGUF file's greedy tokens follow its fp32 dequantized reference:
fastsched's default path (bfloat16, the file's tensors kept quantized) and llama.cpp on the
same file, against fastsched on the same weights dequantized, in float32.

For each of ``--prompts`` fixed prompts (token ids from the file's own tokenizer, the same
ids for every engine) each engine decodes ``--tokens`` greedy tokens, EOS ignored
(fastsched: ``ignore_eos``; llama.cpp: ``Llama.generate`` yields tokens until the caller
stops, and is stopped after ``--tokens``). The figure is the mean length of the common
prefix with the reference's tokens (``--tokens``: all agree), and the prompts that agree
throughout. One greedy divergence changes everything after it, so the prefix, not the
token-by-token match, is what compares.

llama.cpp runs in another interpreter, one with ``llama-cpp-python`` (``--llamacpp-python``,
with ``LLAMA_CPP_LIB_PATH`` in the environment if its shared libraries live elsewhere):

    .venv/bin/python bench/greedy_agreement.py --model FILE.gguf --prompts 8 --tokens 32 \\
        --llamacpp-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
    "Here is a short list of fruits: apples,",
    "To make a cup of tea, first",
    "The mitochondria is the",
    "SELECT name, age FROM users WHERE",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Mean common prefix with the reference and how many prompts agree on every token."""
    prefixes = [common_prefix(o, r) for o, r in zip(outputs, reference, strict=True)]
    return {
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "prefixes": prefixes,
        "all_equal": sum(p == len(r) for p, r in zip(prefixes, reference)),
    }


def fastsched_greedy(
    model: str, prompts: list[list[int]], tokens: int, threads: int, **kwargs: object
) -> list[list[int]]:
    from fastsched import LLM, SamplingParams

    longest = max(len(p) for p in prompts) + tokens
    llm = LLM(
        model,
        num_threads=threads,
        log_stats_interval=0,
        max_model_len=-(-longest // 16) * 16,
        num_gpu_blocks=len(prompts) * (-(-longest // 16)) + 1,
        **kwargs,
    )
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False
    )
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outputs]


def llamacpp_greedy(model: str, prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    """Run inside the llama-cpp-python interpreter (``--worker``)."""
    import llama_cpp

    longest = max(len(p) for p in prompts) + tokens
    llm = llama_cpp.Llama(
        model_path=model,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=longest + 8,
        logits_all=False,
        verbose=False,
    )
    outputs = []
    for ids in prompts:
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == tokens:
                break
        outputs.append(out)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--prompts", type=int, default=8, help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp-python", type=Path, help="an interpreter with llama-cpp-python")
    parser.add_argument("--json", type=Path, help="write the results there too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # llama.cpp, in its own interpreter: prompt ids on stdin, tokens on stdout
        prompts = json.loads(sys.stdin.read())
        outputs = llamacpp_greedy(args.model, prompts, args.tokens, args.threads)
        print("RESULT " + json.dumps(outputs), flush=True)
        return
    if not 1 <= args.prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be 1..{len(PROMPTS)}, got {args.prompts}")
    sys.path.insert(0, str(ROOT / "python"))
    from fastsched.model_loader import load_tokenizer

    tokenizer = load_tokenizer(Path(args.model))
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
    results: dict[str, object] = {"model": args.model, "prompts": args.prompts, "tokens": args.tokens}
    start = time.perf_counter()
    reference = fastsched_greedy(
        args.model, prompts, args.tokens, args.threads, quantization="none", dtype="float32"
    )
    results["reference_s"] = time.perf_counter() - start
    start = time.perf_counter()
    results["fastsched default (bfloat16, quantized)"] = agreement(
        fastsched_greedy(args.model, prompts, args.tokens, args.threads), reference
    )
    results["fastsched_s"] = time.perf_counter() - start
    if args.llamacpp_python is not None:
        command = [
            args.llamacpp_python,
            __file__,
            "--model",
            args.model,
            "--tokens",
            str(args.tokens),
            "--threads",
            str(args.threads),
            "--worker",
        ]
        proc = subprocess.run(command, input=json.dumps(prompts), capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"llama.cpp run failed:\n{proc.stderr[-4000:]}")
        results["llama.cpp"] = agreement(json.loads(line.removeprefix("RESULT ")), reference)
    print(json.dumps(results, indent=1))
    for name in ("fastsched default (bfloat16, quantized)", "llama.cpp"):
        if name in results:
            r = results[name]
            print(
                f"{name}: mean common greedy prefix {r['mean_common_prefix']:.2f} / {args.tokens} "
                f"({r['all_equal']} of {args.prompts} prompts agree throughout)"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
