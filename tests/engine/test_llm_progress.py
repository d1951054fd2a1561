"""``LLM`` as a vLLM user writes it: the progress bar shows what vLLM's shows (prompts
processed, and input and output tokens per second of the finished requests, updated as
requests finish), and vLLM's engine keywords without a knob here are accepted with a warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastsched import LLM, SamplingParams


def test_the_progress_bar_shows_input_and_output_tokens_per_second(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, max_model_len=128)
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "4/4" in err
    assert "est. speed input:" in err and "toks/s, output:" in err
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == 12


def test_use_tqdm_false_prints_no_bar(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM(str(tiny_model_dir), num_gpu_blocks=64, max_model_len=128)
    capsys.readouterr()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_vllm_engine_keywords_are_accepted_as_their_flags_are(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="fastsched.cli"):
        LLM(
            str(tiny_model_dir),
            num_gpu_blocks=64,
            max_model_len=128,
            enforce_eager=True,
            trust_remote_code=True,
            kv_cache_dtype="auto",
        )
    assert [r.message.split(":")[0] for r in caplog.records] == ["--enforce-eager", "--trust-remote-code"]
    with pytest.raises(ValueError, match="fp8 is not supported"):
        LLM(str(tiny_model_dir), kv_cache_dtype="fp8")
    with pytest.raises(TypeError, match="unknown engine arguments: enforce_eagre"):
        LLM(str(tiny_model_dir), enforce_eagre=True)
