"""fastsched against llama.cpp on the same GGUF file and thread count, in one run.

Measured for each engine, each in a process of its own (so its RSS is its own):
- decode tok/s for 1, 8 and 32 sequences (greedy, ``--tokens`` new tokens each, EOS
  ignored): the time of a run of ``--tokens`` tokens minus that of a run of 1 token, over
  the ``n * (tokens - 1)`` tokens between, so prompt processing is left out on both sides;
- prefill tok/s for one ``--prompt-len``-token prompt (1 output token);
- the process's resident memory after all of that (VmRSS; VmHWM too), and for fastsched where
  it went: RSS after ``import torch``, after the engine's imports, after the engine is built
  (model and KV pool), after the first step and at the end, each split into anonymous and
  file-backed pages (``/proc/self/smaps_rollup``).

Both engines get a KV cache of the same size, what the largest batch needs: llama.cpp a
context of ``n * (prompt + tokens + 8)`` tokens per run, fastsched a pool of that many
blocks (``--kv-cache-memory`` overrides it).

llama.cpp comes from ``llama-cpp-python`` (its sdist vendors llama.cpp and builds it for this
CPU), installed on demand into its own virtual environment under ``bench/out/`` (never a
dependency of fastsched); the bench says how long the install took. Batched decoding in
llama.cpp is its own ``llama_batch`` API (one ``llama_decode`` per step over every sequence,
as llama-batched-bench does), driven here through the package's ctypes binding.

    .venv/bin/python bench/cpu_decode.py --threads 2            # both engines
    .venv/bin/python bench/cpu_decode.py --skip-llamacpp --fastsched-args '{"dtype": "float32", "quantization": "none"}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
PROMPT = "The capital of France is"
LLAMACPP_REQUIREMENT = "llama-cpp-python==0.3.36"


PROMPT_TOKENS_MAX = 16  # PROMPT's tokens, with room: sizes fastsched's KV pool before it is tokenized


def rss_mib() -> dict[str, float]:
    status = Path("/proc/self/status").read_text().splitlines()
    fields = {line.split(":")[0]: line.split()[1] for line in status if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss_mib": int(fields["VmRSS"]) / 1024, "peak_rss_mib": int(fields["VmHWM"]) / 1024}


def rss_split_mib() -> list[float]:
    """[resident, anonymous, file-backed] MiB of this process (smaps_rollup)."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split()[:2]
        fields[name.rstrip(":")] = int(value) / 1024
    return [fields["Rss"], fields["Anonymous"], fields["Rss"] - fields["Anonymous"]]


def long_prompt_ids(vocab_ids: list[int], length: int) -> list[int]:
    """A ``length``-token prompt: the short prompt's tokens repeated (the same ids for both engines)."""
    return (vocab_ids * (length // len(vocab_ids) + 1))[:length]


# --- fastsched (this process, when run with --worker fastsched) -------------------------------------


def kv_pool_args(args: argparse.Namespace, block_size: int) -> dict[str, int]:
    """fastsched's KV pool: ``--kv-cache-memory`` bytes if given, else blocks for the largest
    batch's sequences (what llama.cpp's context gets), and a max_model_len for the longest run."""
    longest = max(args.prompt_len + 1, PROMPT_TOKENS_MAX + args.tokens)
    max_model_len = -(-longest // block_size) * block_size
    if args.kv_cache_memory is not None:
        return {"kv_cache_memory": args.kv_cache_memory, "max_model_len": max_model_len}
    per_seq = -(-(PROMPT_TOKENS_MAX + args.tokens) // block_size)
    blocks = max(max(args.batches) * per_seq, max_model_len // block_size) + 1  # + the null block
    return {"num_gpu_blocks": blocks, "max_model_len": max_model_len}


def run_fastsched(args: argparse.Namespace) -> dict[str, object]:
    rss_stages = {"start": rss_split_mib()}

    rss_stages["import torch"] = rss_split_mib()
    sys.path.insert(0, str(ROOT / "python"))
    from fastsched import LLM, SamplingParams
    from fastsched.config import EngineConfig

    rss_stages["engine imports"] = rss_split_mib()
    extra = json.loads(args.fastsched_args)
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        num_threads=args.threads,
        log_stats_interval=0,
        **kv_pool_args(args, extra.get("block_size", EngineConfig.block_size)),
        **extra,
    )
    rss_stages["engine built (model, KV pool)"] = rss_split_mib()
    result: dict[str, object] = {
        "engine": "fastsched",
        "load_s": time.perf_counter() - start,
        "dtype": str(llm.config.torch_dtype).removeprefix("torch."),
        "quantization": llm.config.resolved_quantization,
        "args": extra,
    }
    kv = llm.engine.runner.kv_caches
    result["kv_pool_mib"] = sum(t.numel() * t.element_size() for t in kv) / 2**20
    prompt = llm.tokenizer.encode(PROMPT)
    if len(prompt) > PROMPT_TOKENS_MAX:
        raise SystemExit(
            f"PROMPT is {len(prompt)} tokens; PROMPT_TOKENS_MAX ({PROMPT_TOKENS_MAX}) must be at least that"
        )

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    timed([prompt], 1)
    rss_stages["first step"] = rss_split_mib()
    timed([prompt], 8)  # warm-up
    for n in args.batches:
        runs = []
        for _ in range(args.repeats):
            full, first = timed([prompt] * n, args.tokens), timed([prompt] * n, 1)
            runs.append(n * (args.tokens - 1) / (full - first))
        result[f"decode_{n}_tok_s"] = runs
    long_prompt = long_prompt_ids(prompt, args.prompt_len)
    # Prefix caching would serve a repeated prompt from the cache: each run's prompt differs in its first token.
    result["prefill_tok_s"] = [
        args.prompt_len / timed([[i + 1] + long_prompt[1:]], 1) for i in range(args.repeats)
    ]
    rss_stages["end"] = rss_split_mib()
    result["rss_stages_mib"] = rss_stages  # [resident, anonymous, file-backed]
    result.update(rss_mib())
    return result


# --- llama.cpp (run inside its own venv with --worker llamacpp) -------------------------------------


def run_llamacpp(args: argparse.Namespace) -> dict[str, object]:
    import ctypes

    import llama_cpp
    import numpy as np

    start = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=512, verbose=False
    )
    model = llm._model.model
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    result: dict[str, object] = {
        "engine": "llama.cpp",
        "load_s": time.perf_counter() - start,
        "version": llama_cpp.__version__,
    }
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)

    def new_context(n_seqs: int, n_ctx: int) -> ctypes.c_void_p:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, max(512, n_ctx), 512
        params.n_seq_max, params.n_threads, params.n_threads_batch = n_seqs, args.threads, args.threads
        return llama_cpp.llama_init_from_model(model, params)

    def decode(ctx: ctypes.c_void_p, seqs: list[list[int]], positions: list[int]) -> list[int]:
        """One llama_decode over every sequence's tokens; returns each sequence's greedy next token."""
        total = sum(len(s) for s in seqs)
        batch = llama_cpp.llama_batch_init(total, 0, len(seqs))
        i = 0
        last = []
        for seq, (tokens, pos) in enumerate(zip(seqs, positions)):
            for j, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos + j, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = j == len(tokens) - 1
                i += 1
            last.append(i - 1)
        batch.n_tokens = total
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        llama_cpp.llama_batch_free(batch)
        out = []
        for row in last:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
            out.append(int(logits.argmax()))
        return out

    def timed(n: int, max_tokens: int) -> float:
        ctx = new_context(n, n * (len(prompt) + max_tokens + 8))
        t = time.perf_counter()
        tokens = decode(ctx, [prompt] * n, [0] * n)
        for step in range(max_tokens - 1):
            tokens = decode(ctx, [[tok] for tok in tokens], [len(prompt) + step] * n)
        elapsed = time.perf_counter() - t
        llama_cpp.llama_free(ctx)
        return elapsed

    timed(1, 8)
    for n in args.batches:
        runs = []
        for _ in range(args.repeats):
            full, first = timed(n, args.tokens), timed(n, 1)
            runs.append(n * (args.tokens - 1) / (full - first))
        result[f"decode_{n}_tok_s"] = runs
    long_prompt = long_prompt_ids(prompt, args.prompt_len)
    prefill = []
    for _ in range(args.repeats):
        ctx = new_context(1, args.prompt_len + 8)
        t = time.perf_counter()
        decode(ctx, [long_prompt], [0])
        prefill.append(args.prompt_len / (time.perf_counter() - t))
        llama_cpp.llama_free(ctx)
    result["prefill_tok_s"] = prefill
    result.update(rss_mib())
    return result


def llamacpp_python(venv: Path) -> tuple[Path, float]:
    """The venv's interpreter with llama-cpp-python in it, installing it (from its sdist,
    built for this CPU) if missing; returns it and the seconds the install took (0: present)."""
    python = venv / "bin" / "python"
    if (
        python.exists()
        and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    ):
        return python, 0.0
    start = time.monotonic()
    print(
        f"installing {LLAMACPP_REQUIREMENT} into {venv} (builds llama.cpp from source: minutes)...",
        flush=True,
    )
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-binary",
            "llama-cpp-python",
            LLAMACPP_REQUIREMENT,
            "numpy",
        ],
        check=True,
        env={**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON"},
    )
    took = time.monotonic() - start
    print(f"installed llama-cpp-python in {took:.0f} s", flush=True)
    return python, took


def merge_round(results: dict[str, dict[str, object]], result: dict[str, object]) -> None:
    """Adds one round's result of an engine to the earlier rounds': the runs of each
    measurement appended, everything else (RSS, load time) from the latest round."""
    earlier = results.get(str(result["engine"]))
    if earlier is not None:
        for key, value in result.items():
            if key.endswith("tok_s"):
                result[key] = list(earlier[key]) + list(value)
    results[str(result["engine"])] = result


def summarize(results: list[dict[str, object]]) -> str:
    """Each measurement's range per engine and, with both engines, the ratio of their
    medians (fastsched / llama.cpp; RSS too, where lower is better)."""
    keys = [k for k in results[0] if k.endswith("tok_s")] + ["rss_mib"]
    both = len(results) == 2
    lines = [
        "| | " + " | ".join(str(r["engine"]) for r in results) + (" | ratio |" if both else " |"),
        "| --- |" + " ---: |" * (len(results) + both),
    ]
    for key in keys:
        cells = []
        for r in results:
            value = r.get(key)
            if isinstance(value, list):
                cells.append(f"{min(value):.1f}–{max(value):.1f}" if len(value) > 1 else f"{value[0]:.1f}")
            else:
                cells.append("-" if value is None else f"{value:.0f}")
        if both and all(r.get(key) is not None for r in results):
            medians = [statistics.median(v) if isinstance(v, list) else v for v in (r[key] for r in results)]
            cells.append(f"{medians[0] / medians[1]:.2f}×")
        elif both:
            cells.append("-")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per sequence")
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 8, 32], help="sequence counts to decode"
    )
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of the prefill run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each measurement (all reported)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of the whole bench, the engines alternating (fastsched, llama.cpp, fastsched, "
        "...), so that a shared machine's slow minutes fall on both; all runs are reported",
    )
    parser.add_argument("--fastsched-args", default="{}", help="JSON of extra LLM(...) arguments")
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="fastsched's KV pool in bytes (default: blocks for the largest batch, as llama.cpp's "
        "context is sized)",
    )
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--skip-fastsched", action="store_true", help="llama.cpp alone")
    parser.add_argument(
        "--llamacpp-venv",
        type=Path,
        default=OUT / "llamacpp-venv",
        help="virtual environment holding llama-cpp-python (installed there if missing)",
    )
    parser.add_argument("--json", type=Path, help="write the results there too")
    parser.add_argument("--worker", choices=("fastsched", "llamacpp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT / "python"))
        from fastsched.model_loader import default_model_path

        args.model = str(default_model_path())
    if args.worker:
        result = run_fastsched(args) if args.worker == "fastsched" else run_llamacpp(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    passthrough = [a for a in sys.argv[1:] if a not in ("--skip-llamacpp", "--skip-fastsched")]
    passthrough += ["--model", args.model]
    engines = [] if args.skip_fastsched else [("fastsched", Path(sys.executable))]
    install_s = None
    if not args.skip_llamacpp:
        python, install_s = llamacpp_python(args.llamacpp_venv)
        engines.append(("llamacpp", python))
    from tqdm import tqdm  # here: the llama.cpp worker runs this file in a venv without it

    by_engine: dict[str, dict[str, object]] = {}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for round_ in tqdm(range(args.rounds), desc="rounds", disable=args.rounds == 1):
        for name, python in engines:
            proc = subprocess.run(
                [python, __file__, *passthrough, "--worker", name], capture_output=True, text=True, env=env
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                raise SystemExit(f"{name} run failed (round {round_ + 1}):\n{proc.stderr[-4000:]}")
            merge_round(by_engine, json.loads(line.removeprefix("RESULT ")))
    results = list(by_engine.values())
    if install_s is not None:
        results[-1]["install_s"] = install_s
    print(json.dumps(results, indent=1))
    print(summarize(results))
    for r in results:
        for stage, (rss, anon, file) in r.get("rss_stages_mib", {}).items():
            print(f"{r['engine']} RSS {stage}: {rss:.0f} MiB ({anon:.0f} anonymous, {file:.0f} file-backed)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
