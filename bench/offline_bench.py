"""Offline throughput: fastsched's continuous batching against transformers' static batching.

The workload is ``--num-prompts`` requests with random token-id prompts of uniform
length in [--min-prompt-len, --max-prompt-len] and output lengths uniform in
[--min-output-len, --max-output-len], all drawn from ``--seed``. Every request is
greedy and ignores EOS, so it produces exactly its output length.

- **fastsched**: one ``LLM.generate`` call over all requests, each with
  ``max_tokens`` = its output length. A request leaves the batch when it is done and
  the next one takes its place.
- **transformers (static batching)**: requests in arrival order, in batches of
  ``--hf-batch-size``, padded on the left; each batch runs ``generate`` for the
  longest output length in it, so its short requests wait for its longest one.
  Only the requested tokens count as output; the rest is the cost of static batching.

Both run the same checkpoint in the same process, with the same dtype, device and
torch thread count, after one small warm-up each (not timed). ``--model`` defaults to
the tiny random-weight Llama of ``fastsched.tools.tiny_model``, written to a temporary
directory; a Hugging Face directory or a ``.gguf`` file works too.

The table goes to stdout, progress bars to stderr, and the last line of stdout is
one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from tqdm.auto import tqdm

# Token ids below this are the tiny model's special tokens; skipping them keeps the
# prompts ordinary text for any Llama-style vocabulary too.
FIRST_PROMPT_TOKEN = 3


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    name: str
    seconds: float
    num_requests: int
    num_output_tokens: int  # requested (useful) tokens only
    num_generated_tokens: int  # everything the model produced, padding rows included

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: the tiny model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own choice)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="fastsched engine argument")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="fastsched engine argument")
    parser.add_argument("--skip-hf", action="store_true", help="run fastsched only")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fastsched engine argument (default: the engine's)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if not 1 <= args.min_output_len <= args.max_output_len:
        parser.error("need 1 <= --min-output-len <= --max-output-len")
    return args


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.min_prompt_len, args.max_prompt_len + 1, size=args.num_prompts)
    output_lens = rng.integers(args.min_output_len, args.max_output_len + 1, size=args.num_prompts)
    prompts = [rng.integers(FIRST_PROMPT_TOKEN, vocab_size, size=int(n)).tolist() for n in prompt_lens]
    return Workload(prompts, [int(n) for n in output_lens])


def run_fastsched(args: argparse.Namespace, model: str, workload: Workload) -> Result:
    from fastsched import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_prompt_len + args.max_output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        log_stats_interval=0,
        **({} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}),
    )
    llm.generate(
        workload.prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    _sync(args.device)
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=True)
    _sync(args.device)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"fastsched produced {produced} tokens, {workload.num_output_tokens} requested")
    stats = llm.engine.scheduler.stats()
    print(
        f"fastsched: {stats['num_steps']} steps, {stats['num_preemptions_total']} preemptions",
        file=sys.stderr,
    )
    return Result("fastsched (continuous batching)", seconds, len(outputs), produced, produced)


def load_hf_model(args: argparse.Namespace, model: str):
    import transformers

    path = Path(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    directory = path.parent if path.suffix == ".gguf" else path
    dtype = getattr(torch, args.dtype)
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
        .to(args.device)
        .eval()
    )
    hf.generation_config.eos_token_id = None  # ignore EOS, as fastsched does here
    hf.generation_config.pad_token_id = 0
    return hf


@torch.inference_mode()
def hf_generate_batch(hf, prompts: list[list[int]], max_new_tokens: int, device: str) -> int:
    """Left-padded static batch; returns the number of tokens generated (padding rows included)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, width - len(p) :] = 1
    out = hf.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return (out.shape[1] - width) * len(prompts)


def run_hf(args: argparse.Namespace, model: str, workload: Workload) -> Result:
    hf = load_hf_model(args, model)
    hf_generate_batch(hf, workload.prompts[:2], 4, args.device)
    size = args.hf_batch_size
    batches = [range(i, min(i + size, len(workload.prompts))) for i in range(0, len(workload.prompts), size)]
    generated = 0
    _sync(args.device)
    start = time.perf_counter()
    for batch in tqdm(batches, desc="transformers", unit="batch"):
        longest = max(workload.output_lens[i] for i in batch)
        generated += hf_generate_batch(hf, [workload.prompts[i] for i in batch], longest, args.device)
    _sync(args.device)
    seconds = time.perf_counter() - start
    name = f"transformers generate (static batches of {size})"
    return Result(name, seconds, len(workload.prompts), workload.num_output_tokens, generated)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def print_table(results: list[Result]) -> None:
    print("| system | requests | seconds | requests/s | output tokens/s | generated tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r.name} | {r.num_requests} | {r.seconds:.2f} | {r.requests_per_s:.2f} "
            f"| {r.output_tokens_per_s:.1f} | {r.num_generated_tokens} |"
        )
    if len(results) == 2:
        ratio = results[0].requests_per_s / results[1].requests_per_s
        print(f"| ratio fastsched / transformers | | | {ratio:.2f}x | {ratio:.2f}x | |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="fastsched-bench-") as tmp:
        if args.model is None:
            from fastsched.tools.tiny_model import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny"))
        else:
            model = args.model
        from fastsched.model_loader import load_model_config

        workload = make_workload(args, load_model_config(model).vocab_size)
        results = [run_fastsched(args, model, workload)]
        if not args.skip_hf:
            results.append(run_hf(args, model, workload))

    print(
        f"model: {args.model or 'tiny (fastsched.tools.tiny_model)'}, {args.num_prompts} prompts, "
        f"prompt len {args.min_prompt_len}-{args.max_prompt_len}, output len {args.min_output_len}-"
        f"{args.max_output_len}, seed {args.seed}, {args.dtype} on {args.device}, {torch.get_num_threads()} threads"
    )
    print_table(results)
    summary: dict[str, object] = {
        "num_prompts": args.num_prompts,
        "num_output_tokens": workload.num_output_tokens,
        "fastsched_seconds": round(results[0].seconds, 3),
        "fastsched_requests_per_s": round(results[0].requests_per_s, 3),
        "fastsched_output_tokens_per_s": round(results[0].output_tokens_per_s, 1),
    }
    if len(results) == 2:
        summary.update(
            hf_seconds=round(results[1].seconds, 3),
            hf_requests_per_s=round(results[1].requests_per_s, 3),
            hf_output_tokens_per_s=round(results[1].output_tokens_per_s, 1),
            hf_generated_tokens=results[1].num_generated_tokens,
            speedup=round(results[0].requests_per_s / results[1].requests_per_s, 2),
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
