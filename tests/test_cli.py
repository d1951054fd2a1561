"""The ``fastsched`` command as a vLLM user meets it: vLLM's flag names for shared
concepts (older spellings kept as aliases), sizes with units, defaults in ``--help``,
``--log-level`` after the subcommand, a positional MODEL, ``--version`` and
``python -m fastsched``, ``export-hf``, and cached Hugging Face repo ids."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fastsched.config import EngineConfig
from fastsched.entrypoints.cli import build_parser, main
from fastsched.units import parse_bytes, parse_count

# Flags of `vllm serve` (vLLM 0.33, `vllm serve --help=all`) for concepts fastsched shares.
# A shared concept must carry vLLM's spelling; fastsched's own older names stay as aliases.
VLLM_SHARED_SERVE_FLAGS = (
    "--host",
    "--port",
    "--api-key",
    "--served-model-name",
    "--disable-access-log",
    "--data-parallel-size",
    "--api-server-count",
    "--model",
    "--tokenizer",
    "--dtype",
    "--seed",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--long-prefill-token-threshold",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--scheduling-policy",
    "--block-size",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--num-gpu-blocks-override",
    "--gpu-memory-utilization",
    "--kv-cache-memory-bytes",
    "--tensor-parallel-size",
    "--distributed-executor-backend",
    "--attention-backend",
    "--device",
    "--log-level",
    "--chat-template",
    # What a vLLM user types out of habit (issue 28): each works, or warns once when it means nothing here.
    "--disable-log-requests",
    "--enable-log-requests",
    "--uvicorn-log-level",
    "--disable-uvicorn-access-log",
    "--enforce-eager",
    "--kv-cache-dtype",
    "--trust-remote-code",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
)
OLD_SPELLINGS = (
    "--policy",
    "--num-gpu-blocks",
    "--kv-cache-memory",
    "--no-prefix-caching",
    "--no-chunked-prefill",
)


def subcommand(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_serve_takes_vllm_names_for_every_shared_flag():
    flags = option_strings(subcommand(build_parser(), "serve"))
    missing = [f for f in VLLM_SHARED_SERVE_FLAGS if f not in flags]
    assert not missing, f"vLLM flag names missing from `fastsched serve`: {missing}"


def test_older_flag_spellings_still_work_as_aliases():
    flags = option_strings(subcommand(build_parser(), "serve"))
    assert set(OLD_SPELLINGS) <= flags
    args = parse(
        "serve",
        "--policy",
        "priority",
        "--num-gpu-blocks",
        "64",
        "--kv-cache-memory",
        "8MiB",
        "--no-prefix-caching",
        "--no-chunked-prefill",
    )
    assert (args.policy, args.num_gpu_blocks, args.kv_cache_memory) == ("priority", 64, 8 * 2**20)
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is False
    vllm = parse(
        "serve",
        "--scheduling-policy",
        "priority",
        "--num-gpu-blocks-override",
        "64",
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
    )
    assert (vllm.policy, vllm.num_gpu_blocks, vllm.enable_prefix_caching, vllm.enable_chunked_prefill) == (
        "priority",
        64,
        False,
        False,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32k", 32_000),
        ("32K", 32_768),
        ("2Ki", 2048),
        ("1.5k", 1500),
        ("8192", 8192),
        ("1m", 10**6),
        ("1M", 2**20),
    ],
)
def test_counts_take_vllm_units(text: str, expected: int):
    assert parse_count(text) == expected
    assert parse("serve", "--max-model-len", text).max_model_len == expected


@pytest.mark.parametrize(("text", "expected"), [("8MiB", 8 * 2**20), ("8M", 8 * 2**20), ("8MB", 8 * 10**6)])
def test_byte_sizes_take_units(text: str, expected: int):
    assert parse_bytes(text) == expected
    assert parse("serve", "--kv-cache-memory-bytes", text).kv_cache_memory == expected


def test_a_bad_size_names_the_flag(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        parse("serve", "--max-model-len", "32 bananas")
    assert "--max-model-len" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError, match="whole number"):
        parse_count("1.5")


def test_help_shows_defaults():
    text = subcommand(build_parser(), "serve").format_help()
    assert "(default: 256)" in text  # --max-num-seqs, from the Rust core's SchedulerConfig::default()
    assert "(default: 8000)" in text  # --port


def test_engine_defaults_are_the_rust_cores():
    from fastsched._core import SchedulerConfig

    core, config = SchedulerConfig(), EngineConfig()
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "enable_prefix_caching",
        "watermark",
        "long_prefill_token_threshold",
        "prefill_schedule_interval",
        "enable_chunked_prefill",
        "policy",
    ):
        assert getattr(config, name) == getattr(core, name), name


def test_log_level_is_accepted_after_the_subcommand_too():
    assert parse("serve", "--log-level", "DEBUG").log_level == "DEBUG"
    assert parse("--log-level", "WARNING", "serve").log_level == "WARNING"
    assert parse("version").log_level == "INFO"


def test_positional_model_and_the_flag_name_the_same_model():
    assert parse("serve", "/models/a").model_tag == "/models/a"
    with pytest.raises(ValueError, match="disagree"):
        from fastsched.entrypoints.cli import _resolve_model

        _resolve_model(parse("serve", "/models/a", "--model", "/models/b"))


def test_tensor_parallel_size_below_one_and_an_unknown_executor_are_clear_errors():
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be mp or ray; got 'mpi'"):
        EngineConfig(distributed_executor_backend="mpi")


def test_version_flag_subcommand_and_python_m(capsys: pytest.CaptureFixture[str]):
    from fastsched import _core

    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fastsched ") and _core.__version__ in out
    result = subprocess.run(
        [sys.executable, "-m", "fastsched", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == out.strip()


def test_served_model_name_takes_several_names():
    assert parse("serve", "--served-model-name", "a", "b").served_model_name == ["a", "b"]


def test_export_hf_round_trips_config_and_tokenizer(tmp_path: Path):
    from fastsched.model_loader import load_model_config, load_tokenizer
    from fastsched.tools.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    out = tmp_path / "export"
    assert main(["export-hf", str(out), "--model", str(model), "--weights"]) == 0
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    }
    assert load_model_config(out) == load_model_config(model)
    text = "Hello world, the capital of France is Paris."
    original, exported = load_tokenizer(model), load_tokenizer(out)
    assert exported.encode(text) == original.encode(text)
    assert exported.eos_token_ids == original.eos_token_ids


def test_export_of_the_embedded_gguf_tokenizes_like_it(tmp_path: Path):
    """The launcher hands frontends this export instead of the GGUF file (start-up time)."""
    from fastsched.model_loader import load_tokenizer
    from fastsched.model_loader.export import export_tokenizer

    out = export_tokenizer(None, tmp_path / "smollm2")
    original, exported = load_tokenizer(None), load_tokenizer(out)
    messages = [{"role": "user", "content": "What is 2 + 2? Answer in digits: 12345."}]
    assert exported.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    ) == original.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert exported.eos_token_ids == original.eos_token_ids
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_a_cached_hugging_face_repo_id_resolves_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from fastsched.model_loader import resolve_model_path
    from fastsched.tools.tiny_model import make_tiny_model

    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "0123abcd"
    make_tiny_model(snapshot, seed=0)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert resolve_model_path("acme/tiny") == snapshot
    with pytest.raises(FileNotFoundError, match=str(cache)) as missing:
        resolve_model_path("acme/absent")
    # The next step, exactly: the command that fetches it into the cache this process reads.
    assert f"`hf download acme/absent --cache-dir {cache}`" in str(missing.value)


def test_vllm_flags_without_meaning_here_warn_once(caplog: pytest.LogCaptureFixture):
    from fastsched.entrypoints.vllm_compat import check_vllm_compat_args

    args = parse(
        "serve",
        "--enforce-eager",
        "--trust-remote-code",
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    )
    assert (args.enable_log_requests, args.disable_access_log, args.uvicorn_log_level) == (
        False,
        True,
        "warning",
    )
    with caplog.at_level("WARNING", logger="fastsched.cli"):
        check_vllm_compat_args(args)
    assert [r.message.split(":")[0] for r in caplog.records] == ["--enforce-eager", "--trust-remote-code"]
    assert parse("generate", "--enforce-eager").enforce_eager  # the offline command takes them too


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (("--kv-cache-dtype", "fp8"), "fp8 is not supported"),
        (("--kv-cache-dtype", "float16"), "give --dtype float16"),
        (("--enable-auto-tool-choice",), "needs --tool-call-parser"),
        (("--tool-call-parser", "hermes"), "add --enable-auto-tool-choice"),
    ],
)
def test_vllm_flags_that_cannot_work_here_are_early_errors(
    argv: tuple[str, ...], error: str, capsys: pytest.CaptureFixture[str]
):
    assert main(["serve", *argv]) == 2
    assert error in capsys.readouterr().err


def test_vllm_flags_that_work_reach_the_server_config(monkeypatch: pytest.MonkeyPatch):
    from fastsched.entrypoints.vllm_compat import check_vllm_compat_args

    args = parse(
        "serve",
        "--kv-cache-dtype",
        "bfloat16",
        "--dtype",
        "bfloat16",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "llama3_json",
    )
    check_vllm_compat_args(args)
    seen = {}
    monkeypatch.setattr(
        "fastsched.launcher.serve.serve", lambda config: seen.setdefault("config", config) and 0
    )
    from fastsched.entrypoints.cli import cmd_serve

    cmd_serve(args)
    assert seen["config"].tool_call_parser == "llama3_json"
    assert seen["config"].uvicorn_log_level is None


def test_an_unknown_flag_shows_the_commands_usage_and_the_closest_flag(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        main(["serve", "--max-num-sequences", "8"])
    err = capsys.readouterr().err
    assert err.startswith("usage: fastsched serve") and "did you mean --max-num-seqs?" in err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--qsp", "2"])
    assert "usage: fastsched bench serve" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-num-batched-tokens", "10", "--max-num-seqs", "20"], "--max-num-batched-tokens"),
        (["--watermark", "2"], "--watermark"),
        (["--max-num-queued-reqs", "0"], "--max-num-queued-reqs"),
        (["--ttft-slo", "-1"], "--ttft-slo"),
        (["--engine-timeout", "0"], "--engine-timeout"),
        (["--max-n", "0"], "--max-n"),
    ],
)
def test_serve_refuses_a_bad_setting_before_spawning_anything(flags, flag, monkeypatch, capsys):
    """Issue 28: a setting that needs no model to be judged is refused before any child process
    starts, with one line naming its flag, and a non-zero exit."""
    from fastsched.entrypoints.cli import main
    from fastsched.launcher import serve as launcher

    spawned = []
    monkeypatch.setattr(
        launcher, "_spawn", lambda *a, **k: spawned.append(a) or pytest.fail("a child was spawned")
    )
    assert main(["serve", *flags, "--port", "0", "--grpc-port", "0"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fastsched: error: {flag}: "), err
    assert not spawned


def test_an_empty_api_key_in_the_environment_is_an_error_not_auth_off(monkeypatch, capsys):
    """Issue 22: FASTSCHED_API_KEY="" used to mean no key at all."""
    from fastsched.launcher import serve as launcher

    monkeypatch.setenv("FASTSCHED_API_KEY", "")
    monkeypatch.setattr(launcher, "_spawn", lambda *a, **k: pytest.fail("a child was spawned"))
    assert main(["serve", "--port", "0", "--grpc-port", "0"]) != 0
    assert "FASTSCHED_API_KEY is set but empty" in capsys.readouterr().err
