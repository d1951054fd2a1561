"""``fastsched perplexity``: a model's perplexity over a text, and with ``--kl-divergence`` how
far its next-token distributions are from a reference run of the same model (by default the
same weights dequantized to fp32): what a quantized path costs in quality.

The conventions are llama.cpp's ``llama-perplexity``, so that the figures stand beside its
own: the text is tokenized once and cut into windows of ``--ctx`` tokens (the rest dropped;
a tokenizer that adds BOS gets BOS as each window's first token), and in each window only
the second half is scored (position ``i`` for ``i > ctx // 2``), so that every scored
token has at least half a window of context. Reported: PPL = exp(mean NLL) with its
standard error; with a reference, its PPL, Δppl, mean ln(PPL ratio), the mean KL divergence
KL(reference ‖ model) over scored tokens with its standard error, its 99th percentile,
and top-1 agreement (the share of positions where both pick the same most likely token).

Both runs go through the engine (an ``EngineCore``, prefill-only requests with
``prompt_logprobs``), so they run what serving runs. ``--decode`` computes one token per
step (``max_num_batched_tokens=1``): the single-stream decode path (one row a step through
the decoder stack, the GEMV kernels and the LM head) instead of prefill chunks. The whole
distributions are read through the runner's ``prompt_logprobs_tap``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODEL_FLAGS = ("quantization", "dtype", "device", "attention_backend", "num_threads")


@dataclass
class PerplexityReport:
    """What one run measured (``--json`` prints it as is)."""

    model: str
    text: str
    ctx: int
    mode: str  # prefill | decode
    num_windows: int
    num_scored: int
    ppl: float
    ppl_stderr: float
    reference: str | None = None
    reference_ppl: float | None = None
    delta_ppl: float | None = None
    mean_ln_ppl_ratio: float | None = None
    mean_kld: float | None = None
    mean_kld_stderr: float | None = None
    kld_p99: float | None = None
    top1_agreement: float | None = None  # a fraction in [0, 1]
    top1_agreement_stderr: float | None = None

    def table(self) -> str:
        """The figures as llama-perplexity names them, one a line."""
        head = (
            f"model {self.model}  text {self.text}  ctx {self.ctx}  mode {self.mode}  "
            f"{self.num_windows} windows, {self.num_scored} tokens scored"
        )
        rows = [("PPL", f"{self.ppl:.4f} ± {self.ppl_stderr:.4f}")]
        if self.mean_kld is not None:
            assert self.reference_ppl is not None and self.delta_ppl is not None
            assert self.mean_ln_ppl_ratio is not None and self.mean_kld_stderr is not None
            assert self.kld_p99 is not None and self.top1_agreement is not None
            assert self.top1_agreement_stderr is not None
            rows += [
                ("PPL(base)", f"{self.reference_ppl:.4f}   (reference: {self.reference})"),
                ("Δppl", f"{self.delta_ppl:+.4f}"),
                ("Mean ln(PPL/PPL(base))", f"{self.mean_ln_ppl_ratio:+.6f}"),
                ("Mean KLD", f"{self.mean_kld:.6f} ± {self.mean_kld_stderr:.6f}"),
                ("99.0% KLD", f"{self.kld_p99:.6f}"),
                ("Same top p", f"{100 * self.top1_agreement:.3f} ± {100 * self.top1_agreement_stderr:.3f} %"),
            ]
        width = max(len(name) for name, _ in rows)
        return "\n".join([head, *(f"{name:<{width}}  {value}" for name, value in rows)])


def windows(token_ids: Sequence[int], ctx: int, bos_token_id: int | None) -> list[list[int]]:
    """The text's whole windows of ``ctx`` tokens, each led by BOS when the tokenizer adds one."""
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4, got {ctx}")
    if len(token_ids) < ctx:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of ctx ({ctx})")
    out = []
    for start in range(0, len(token_ids) - ctx + 1, ctx):
        window = list(token_ids[start : start + ctx])
        if bos_token_id is not None:
            window[0] = bos_token_id
        out.append(window)
    return out


class _WindowRecorder:
    """Collects, through the runner's tap, the full log-softmax rows of one window's scored
    positions (``>= first``), in position order."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.rows: dict[int, torch.Tensor] = {}

    def __call__(self, plan: Any, lo: int, logprobs: torch.Tensor) -> None:
        positions = plan.row_positions()[lo : lo + len(logprobs)]
        keep = np.flatnonzero(positions >= self.first)
        for i in keep.tolist():
            self.rows[int(positions[i])] = logprobs[i].to("cpu", copy=True)

    def take(self) -> torch.Tensor:
        rows = torch.stack([self.rows[p] for p in sorted(self.rows)])
        self.rows = {}
        return rows


class _Runner:
    """One engine that scores windows: the full distributions at their scored positions."""

    def __init__(self, engine_kwargs: dict[str, Any], ctx: int, decode: bool) -> None:
        from fastsched.config import EngineConfig
        from fastsched.engine.core import EngineCore

        budget: dict[str, Any] = dict(max_num_seqs=1, max_num_batched_tokens=1) if decode else {}
        self.engine = EngineCore(
            EngineConfig(**engine_kwargs, max_model_len=ctx + 1, log_stats_interval=0, **budget)
        )
        self.recorder = _WindowRecorder(ctx // 2)
        self.engine.runner.prompt_logprobs_tap = self.recorder
        self.num_windows = 0

    def score(self, window: list[int]) -> torch.Tensor:
        """[scored, vocab] log-probs: row ``j`` predicts ``window[first + 1 + j]``."""
        from fastsched.engine.protocol import EngineCoreRequest
        from fastsched.sampling_params import SamplingParams

        self.num_windows += 1
        params = SamplingParams(max_tokens=0, prompt_logprobs=0)  # prefill-only (S20), every position scored
        self.engine.add_request(EngineCoreRequest(f"window-{self.num_windows}", window, params))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return self.recorder.take()


def _stderr(values: np.ndarray) -> float:
    return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def measure(
    text_path: str,
    ctx: int,
    engine_kwargs: dict[str, Any],
    reference_kwargs: dict[str, Any] | None,
    decode: bool = False,
    progress: bool = True,
    max_windows: int | None = None,
) -> PerplexityReport:
    """Runs the model (and the reference, when given) over the text's windows (the first
    ``max_windows`` of them, when given: llama-perplexity's ``--chunks``)."""
    from tqdm.auto import tqdm

    from fastsched.model_loader import load_tokenizer

    text = Path(text_path).read_text(encoding="utf-8")
    model = engine_kwargs.get("model")
    tokenizer = load_tokenizer(engine_kwargs.get("tokenizer") or model)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]
    chunks = windows(tokenizer.encode(text), ctx, bos if adds_bos else None)[:max_windows]
    first = ctx // 2
    runner = _Runner(engine_kwargs, ctx, decode)
    reference = None if reference_kwargs is None else _Runner(reference_kwargs, ctx, decode)
    nll, ref_nll, kld, same = [], [], [], []
    for window in tqdm(chunks, desc="perplexity", unit="window", disable=not progress):
        targets = torch.tensor(window[first + 1 :])
        rows = runner.score(window)
        nll.append(-rows.gather(1, targets[:, None]).squeeze(1))
        if reference is not None:
            ref = reference.score(window)
            ref_nll.append(-ref.gather(1, targets[:, None]).squeeze(1))
            kld.append(torch.nn.functional.kl_div(rows, ref, reduction="none", log_target=True).sum(dim=1))
            same.append(ref.argmax(dim=1) == rows.argmax(dim=1))
    nll_all = torch.cat(nll).double().numpy()
    ppl = math.exp(nll_all.mean())
    report = PerplexityReport(
        model=model or "SmolLM2-135M-Instruct (embedded)",
        text=text_path,
        ctx=ctx,
        mode="decode" if decode else "prefill",
        num_windows=len(chunks),
        num_scored=len(nll_all),
        ppl=ppl,
        ppl_stderr=ppl * _stderr(nll_all),
    )
    if reference_kwargs is not None:
        ref_all = torch.cat(ref_nll).double().numpy()
        kld_all = torch.cat(kld).double().numpy()
        agree = torch.cat(same).double().numpy()
        report.reference = _describe(reference_kwargs)
        report.reference_ppl = math.exp(ref_all.mean())
        report.delta_ppl = ppl - report.reference_ppl
        report.mean_ln_ppl_ratio = float((nll_all - ref_all).mean())
        report.mean_kld, report.mean_kld_stderr = float(kld_all.mean()), _stderr(kld_all)
        report.kld_p99 = float(np.percentile(kld_all, 99))
        report.top1_agreement, report.top1_agreement_stderr = float(agree.mean()), _stderr(agree)
    return report


def _describe(kwargs: dict[str, Any]) -> str:
    name = kwargs.get("model") or "embedded"
    quantization = kwargs.get("quantization") or "default"
    return f"{name}, quantization {quantization}, dtype {kwargs.get('dtype', 'auto')}"


def add_perplexity_parser(
    subparsers: argparse._SubParsersAction,  # type: ignore[type-arg]
) -> argparse.ArgumentParser:
    """Add the ``perplexity`` subcommand to ``subparsers`` and return it."""
    p = subparsers.add_parser(
        "perplexity",
        help="perplexity over a text file; with --kl-divergence, KL divergence to an fp32 reference",
        description="Score a text in windows of --ctx tokens (the second half of each window scored, as "
        "llama-perplexity does) through the engine, and print perplexity; with --kl-divergence "
        "also the KL divergence, its 99th percentile, top-1 agreement and Δppl against a "
        "reference run of the same model (default: the same weights dequantized to fp32).",
    )
    p.add_argument("file", help="the text file (UTF-8)")
    p.add_argument("--model", default=None, help="the model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (default: 512)")
    p.add_argument(
        "--chunks",
        type=int,
        default=None,
        metavar="N",
        help="score only the first N windows (llama-perplexity's --chunks; default: all)",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="one token per step through the decode path instead of prefill chunks",
    )
    p.add_argument("--kl-divergence", action="store_true", help="compare with the reference run")
    p.add_argument("--reference-model", default=None, help="the reference's model (default: --model)")
    p.add_argument(
        "--reference-quantization", default="none", help="the reference's --quantization (default: none)"
    )
    p.add_argument("--reference-dtype", default="float32", help="the reference's --dtype (default: float32)")
    p.add_argument("--quantization", "-q", default=None, help="as fastsched serve's")
    p.add_argument("--dtype", default="auto", help="as fastsched serve's (default: auto)")
    p.add_argument(
        "--device", default="auto", help="cpu, cuda or cuda:N (default: auto, as fastsched serve's)"
    )
    p.add_argument("--attention-backend", default=None, help="as fastsched serve's")
    p.add_argument("--num-threads", type=int, default=None, help="CPU intra-op threads")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.set_defaults(func=run_perplexity)
    return p


def run_perplexity(args: argparse.Namespace) -> int:
    engine = {"model": args.model, **{name: getattr(args, name) for name in MODEL_FLAGS}}
    reference = None
    if args.kl_divergence:
        reference = {
            **engine,
            "model": args.reference_model or args.model,
            "quantization": args.reference_quantization,
            "dtype": args.reference_dtype,
        }
    torch.manual_seed(0)
    if args.chunks is not None and args.chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {args.chunks}")
    report = measure(
        args.file,
        args.ctx,
        engine,
        reference,
        decode=args.decode,
        progress=not args.json,
        max_windows=args.chunks,
    )
    print(json.dumps(asdict(report)) if args.json else report.table(), file=sys.stdout)
    return 0
