"""Flags a vLLM user types that are not engine knobs of their own here: the tool-call
parser of ``tool_choice: "auto"``, uvicorn's log switches, and engine flags that mean
nothing for fastsched (accepted with one warning saying why, so that a vLLM command line
runs). ``add_vllm_compat_args`` adds them to a command; ``check_vllm_compat_args`` reads
them once parsed: warnings, and errors for combinations that cannot work."""

from __future__ import annotations

import argparse
import difflib
import logging
from collections.abc import Sequence

from fastsched.config import DTYPES

logger = logging.getLogger("fastsched.cli")

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
KV_CACHE_DTYPES = ("auto", *DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2")


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's argument group called ``title`` (a new one if there is none)."""
    found = next((g for g in parser._action_groups if g.title == title), None)
    return found if found is not None else parser.add_argument_group(title)


def add_vllm_engine_compat_args(parser: argparse.ArgumentParser) -> None:
    """vLLM engine flags without an effect of their own here (every command that runs a model)."""
    m = _group(parser, "model and device")
    m.add_argument(
        "--enforce-eager",
        action="store_true",
        help="accepted for vLLM command lines: fastsched captures no CUDA graphs, every step already "
        "runs eagerly",
    )
    m.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM command lines: the loader runs no code from the checkpoint (it reads "
        "Llama-family weights and configs itself), so there is no remote code to trust",
    )
    k = _group(parser, "KV cache")
    k.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="dtype of the KV cache; fastsched keeps it in the model's dtype, so a value other than auto "
        "must equal --dtype (fp8 KV caches are not supported)",
    )


def add_vllm_serve_compat_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's serving flags: tool-call parsing, uvicorn's log switches, the old request-log switch."""
    from fastsched.gateway.tool_parsers import PARSERS  # not loaded by LLM(...), which needs none

    n = _group(parser, "network")
    n.add_argument(
        "--disable-uvicorn-access-log",
        dest="disable_access_log",
        action="store_true",
        help="same as --disable-access-log (vLLM's spelling); /health, /ping and /metrics probes are "
        "never access-logged unless --uvicorn-log-level is debug",
    )
    n.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=UVICORN_LOG_LEVELS,
        help="level of uvicorn's own loggers (server and access log; debug also logs the probes) "
        "(default: --log-level's)",
    )
    n.add_argument(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        help="same as --no-enable-log-requests, the default (vLLM's older spelling)",
    )
    t = _group(parser, "tool calls")
    t.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default when a request sends tools): the model decides, and '
        "--tool-call-parser finds its calls in its text (without it, auto works only when the chat "
        "template writes Hermes <tool_call> blocks)",
    )
    t.add_argument(
        "--tool-call-parser",
        default=None,
        choices=tuple(PARSERS),
        help="with --enable-auto-tool-choice: the model family's format of tool calls: hermes (Hermes, "
        "Qwen 2.5), llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS]), pythonic "
        "([f(x=1)], Llama 3.2/4)",
    )


def check_vllm_engine_options(
    enforce_eager: bool = False,
    trust_remote_code: bool = False,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
) -> None:
    """vLLM's engine options that fastsched has no knob for (flags, or ``LLM(...)`` keywords):
    one warning for those without effect, a ValueError for a KV cache dtype it cannot keep."""
    if enforce_eager:
        logger.warning(
            "--enforce-eager: fastsched captures no CUDA graphs, so every step runs eagerly anyway"
        )
    if trust_remote_code:
        logger.warning("--trust-remote-code: fastsched's loader never runs code from a checkpoint; ignored")
    if kv_cache_dtype.startswith("fp8"):
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} is not supported: fastsched keeps the KV cache in the "
            f"model's dtype ({', '.join(DTYPES)}; --dtype)"
        )
    if kv_cache_dtype != "auto" and kv_cache_dtype != dtype:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype}: the KV cache is kept in the model's dtype (--dtype "
            f"{dtype}); give --dtype {kv_cache_dtype} to store both in {kv_cache_dtype}"
        )


def pop_vllm_engine_kwargs(kwargs: dict[str, object]) -> dict[str, object]:
    """``LLM(...)`` keywords without the vLLM-only options (checked as the flags are)."""
    if kwargs.get("kv_cache_dtype", "auto") not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kwargs['kv_cache_dtype']!r}"
        )
    rest = dict(kwargs)
    check_vllm_engine_options(
        bool(rest.pop("enforce_eager", False)),
        bool(rest.pop("trust_remote_code", False)),
        str(rest.pop("kv_cache_dtype", "auto")),
        str(rest.get("dtype", "auto")),
    )
    return rest


def check_vllm_compat_args(args: argparse.Namespace) -> None:
    """Warnings for the flags accepted without effect; a ValueError for what cannot work."""
    check_vllm_engine_options(
        getattr(args, "enforce_eager", False),
        getattr(args, "trust_remote_code", False),
        getattr(args, "kv_cache_dtype", "auto"),
        getattr(args, "dtype", "auto"),
    )
    from fastsched.gateway.tool_parsers import PARSERS

    auto, parser = getattr(args, "enable_auto_tool_choice", False), getattr(args, "tool_call_parser", None)
    if auto and parser is None:
        raise ValueError(
            f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(PARSERS)}): the format in "
            "which the model writes its calls"
        )
    if parser is not None and not auto:
        raise ValueError(
            f'--tool-call-parser {parser} is used for tool_choice "auto" only: add --enable-auto-tool-choice'
        )


def closest_flag(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """``unrecognized arguments: ...``, with the known flag closest to the first unknown one."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    first = next((u.partition("=")[0] for u in unknown if u.startswith("-")), None)
    if first is None:
        return message
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    close = difflib.get_close_matches(first, known, n=1, cutoff=0.6)
    return message + (f" (did you mean {close[0]}?)" if close else "")


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser that ``args`` were parsed by, as deep as subcommands go."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                return command_parser(action.choices[chosen], args)
    return parser
