"""The quality of the path users run: ``fastsched perplexity --kl-divergence`` on the embedded
Q4_1 model and the paragraph in tests/models/data, the default path (4-bit weights kept
4-bit, the default dtype and attention backend) against the same weights dequantized to fp32,
through the engine in both modes: prefill chunks, and ``--decode``, one token a step through
what single-stream decode runs (the decoder stack, the int8-activation GEMV, the Rust
attention, the LM head).

Bounds, with what they were set from (this machine, bf16 activations; 2 windows of 64
tokens, 62 scored): prefill mean KLD 0.0007, 99th percentile 0.0027, top-1 agreement 100 %;
decode mean KLD 0.0040, 99th percentile 0.014, top-1 agreement 96.8 % (2 of 62 differ).
A wrong kernel row, a stale KV slot or a mis-scaled quantization group costs KL divergences
of 0.05 and more and disagrees on many tokens; the bounds leave about 2-3x the measured
figures for the arithmetic of another CPU (fp32 activations where bf16 is not native give
smaller ones).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fastsched.tools.perplexity import measure, windows

TEXT = str(Path(__file__).parent / "data" / "perplexity.txt")
CTX = 64
DEFAULT = {
    "model": None,
    "quantization": None,
    "dtype": "auto",
    "device": "cpu",
    "attention_backend": None,
    "num_threads": None,
}
REFERENCE = {**DEFAULT, "quantization": "none", "dtype": "float32"}
BOUNDS = {  # mode: (mean KLD, 99th percentile KLD, top-1 agreement at least)
    "prefill": (0.002, 0.01, 0.95),
    "decode": (0.01, 0.04, 0.93),
}


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_default_path_is_close_to_fp32_by_kl_divergence_and_top1(mode: str) -> None:
    report = measure(TEXT, CTX, DEFAULT, REFERENCE, decode=mode == "decode", progress=False)
    assert (report.num_windows, report.num_scored) == (2, 2 * (CTX - 1 - CTX // 2))
    max_kld, max_p99, min_top1 = BOUNDS[mode]
    summary = (report.mean_kld, report.kld_p99, report.top1_agreement, report.ppl, report.reference_ppl)
    assert report.mean_kld <= max_kld, summary
    assert report.kld_p99 <= max_p99, summary
    assert report.top1_agreement >= min_top1, summary
    assert abs(report.mean_ln_ppl_ratio) <= 0.05, summary  # perplexity within ~5 %


def test_windows_follow_llama_perplexity() -> None:
    ids = list(range(10, 30))
    assert windows(ids, 8, None) == [ids[0:8], ids[8:16]]  # the rest (4 tokens) dropped
    assert windows(ids, 8, 1)[1] == [1, *ids[9:16]]  # BOS replaces each window's first token
    with pytest.raises(ValueError, match="fewer than one window of ctx \\(32\\)"):
        windows(ids, 32, None)
