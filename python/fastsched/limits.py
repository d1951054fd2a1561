"""The server's limits on what a client controls (docs/serving.md "Limits"), defined once.

Every size a request can set has a bound here, with a ``fastsched serve`` flag built from
the field (``add_request_limit_args``), so that no single request can grow a process by
gigabytes or hold an event loop for seconds. The gateway checks what it can before any
work (body, headers, JSON shape, prompt count, ``n``, stop strings); the frontend checks
again what reaches it over gRPC, which clients may call directly. A request over a limit
can never succeed, so it is a client error (400, or 413/431 where HTTP has a code for it)
whose message names the field, the value and the limit, never a retryable 503.

A prompt's text is bounded before it is tokenized: no token of the vocabulary is longer
than ``max_token_chars`` characters (the longest entry of the vocabulary, added tokens
included), so a text longer than ``max_model_len × max_token_chars`` characters cannot
fit in ``max_model_len`` tokens whatever the tokenizer does with it (normalizers that
delete characters aside: none of the supported checkpoints has one).

Leaf module: it imports nothing of fastsched, so the gateway and the frontend both use it.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

# The sampler works in float32: a larger parameter becomes inf there.
FLOAT32_MAX = 3.4028234663852886e38
# Prompts up to this many characters are tokenized inline; longer ones in a worker
# thread, so that the event loop goes on serving other requests meanwhile.
INLINE_TOKENIZE_CHARS = 4096
# What a request id may hold: printable ASCII, no space (it goes into logs and headers).
_PRINTABLE_ID = re.compile(r"[!-~]*")


class LimitError(ValueError):
    """A request over one of the server's limits: a client error that can never succeed.
    ``field`` is the request field; ``status`` the HTTP status (400, 413 or 431)."""

    def __init__(self, message: str, field: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def _limit(help: str, metavar: str = "N") -> dict[str, Any]:
    return {"help": help, "metavar": metavar}


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what a request controls; one flag per field (``--max-n`` ...)."""

    max_n: int = field(
        default=128,
        metadata=_limit(
            "most completions one request may ask for (`n`, and `best_of`, which must equal it); OpenAI's bound"
        ),
    )
    max_prompts_per_request: int = field(
        default=128,
        metadata=_limit(
            "most prompts in one /v1/completions request (a list of prompts); each is a request at a frontend"
        ),
    )
    max_stop_sequences: int = field(
        default=32,
        metadata=_limit(
            "most stop strings per request: every generated token is checked against each of them"
        ),
    )
    max_stop_sequence_length: int = field(
        default=256, metadata=_limit("longest stop string, in characters (the per-token cost grows with it)")
    )
    max_stop_token_ids: int = field(
        default=128,
        metadata=_limit(
            "most stop_token_ids per request: the scheduler checks every generated token against each of them"
        ),
    )
    max_structured_outputs_chars: int = field(
        default=128 * 1024,
        metadata=_limit(
            "longest output constraint, in characters: a JSON schema's text, a regex, a grammar, or a choice list's "
            "strings together (checked before it is compiled)",
            "CHARS",
        ),
    )
    max_structured_outputs_choices: int = field(
        default=1024, metadata=_limit("most strings in a structured-outputs choice list (guided_choice)")
    )
    max_messages: int = field(
        default=1024,
        metadata=_limit("most messages in one /v1/chat/completions request (or /tokenize of messages)"),
    )
    max_tools: int = field(default=128, metadata=_limit("most tools in one chat request (OpenAI's bound)"))
    max_session_chunks: int = field(
        default=4096,
        metadata=_limit(
            "most chunks one streaming-input session (/v1/sessions, gRPC GenerateSession) may send, its opening "
            "prompt included"
        ),
    )
    prepare_timeout: float = field(
        default=30.0,
        metadata=_limit(
            "seconds a frontend gives one request's tokenizing and grammar compilation (done in a worker thread, "
            "never on the event loop) before refusing it",
            "SECONDS",
        ),
    )
    max_request_id_length: int = field(
        default=256,
        metadata=_limit(
            "longest request id accepted over gRPC, in characters (ids are remembered for /debug/requests); "
            "the gateway's X-Request-Id is at most 128"
        ),
    )
    max_body_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata=_limit(
            "largest HTTP request body (413 above it) or WebSocket message (closed with 1009 above it)",
            "BYTES",
        ),
    )
    max_json_depth: int = field(
        default=32, metadata=_limit("deepest nesting of objects and arrays in a JSON body")
    )
    max_header_bytes: int = field(
        default=32 * 1024, metadata=_limit("largest HTTP request line plus headers (431 above it)", "BYTES")
    )
    header_timeout: float = field(
        default=10.0,
        metadata=_limit(
            "seconds a client has to send a request's line and headers once connected (or once the previous "
            "response on a kept-alive connection is sent)",
            "SECONDS",
        ),
    )
    body_timeout: float = field(
        default=60.0,
        metadata=_limit("seconds a client has to send a request's whole body (408 after it)", "SECONDS"),
    )
    max_concurrent_streams: int = field(
        default=1024,
        metadata=_limit(
            "most Generate calls one gRPC frontend serves at once; more get RESOURCE_EXHAUSTED, which the gateway "
            "answers 503 (retry later) after trying the other frontends"
        ),
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{f.name} must be a positive number, got {value!r}")
        if self.max_request_id_length < 128 + 12:
            raise ValueError(
                "max_request_id_length must be at least 140 (a 128-character X-Request-Id plus the "
                f"gateway's '-<prompt index>'), got {self.max_request_id_length}"
            )

    # ------------------------------------------------------------ checks

    def check_n(self, n: int, name: str = "n") -> None:
        if n > self.max_n:
            raise LimitError(f"{name} is {n}, more than this server's limit of {self.max_n} (--max-n)", name)

    def check_num_prompts(self, count: int) -> None:
        if count > self.max_prompts_per_request:
            raise LimitError(
                f"prompt has {count} prompts, more than this server's limit of "
                f"{self.max_prompts_per_request} per request (--max-prompts-per-request)",
                "prompt",
            )

    def check_stop(self, stop: Iterable[str]) -> None:
        stops = list(stop)
        if len(stops) > self.max_stop_sequences:
            raise LimitError(
                f"stop has {len(stops)} strings, more than this server's limit of "
                f"{self.max_stop_sequences} (--max-stop-sequences)",
                "stop",
            )
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_sequence_length:
            raise LimitError(
                f"stop has a string of {longest} characters, longer than this server's limit of "
                f"{self.max_stop_sequence_length} (--max-stop-sequence-length)",
                "stop",
            )

    def check_request_id(self, request_id: str) -> None:
        """Bounded, and printable ASCII only: ids are logged and echoed in headers, where a
        newline or an escape sequence would forge log lines (issue 22)."""
        if len(request_id) > self.max_request_id_length:
            raise LimitError(
                f"request_id has {len(request_id)} characters, more than this server's limit of "
                f"{self.max_request_id_length} (--max-request-id-length)",
                "request_id",
            )
        if not _PRINTABLE_ID.fullmatch(request_id):
            raise LimitError(
                f"request_id {request_id[:64]!r} must be printable ASCII without spaces", "request_id"
            )

    def check_stop_token_ids(self, count: int) -> None:
        if count > self.max_stop_token_ids:
            raise LimitError(
                f"stop_token_ids has {count} ids, more than this server's limit of "
                f"{self.max_stop_token_ids} (--max-stop-token-ids)",
                "stop_token_ids",
            )

    def check_structured_outputs(self, kind: str, value: str | Sequence[str]) -> None:
        """A constraint's size, before anything compiles it: ``value`` is the text of a
        schema, regex or grammar, or a choice list."""
        name = f"structured_outputs.{kind}"
        if not isinstance(value, str):
            if len(value) > self.max_structured_outputs_choices:
                raise LimitError(
                    f"{name} has {len(value)} strings, more than this server's limit of "
                    f"{self.max_structured_outputs_choices} (--max-structured-outputs-choices)",
                    "structured_outputs",
                )
            chars = sum(len(v) for v in value)
        else:
            chars = len(value)
        if chars > self.max_structured_outputs_chars:
            raise LimitError(
                f"{name} has {chars} characters, more than this server's limit of "
                f"{self.max_structured_outputs_chars} (--max-structured-outputs-chars)",
                "structured_outputs",
            )

    def check_messages(self, count: int) -> None:
        if count > self.max_messages:
            raise LimitError(
                f"messages has {count} messages, more than this server's limit of {self.max_messages} "
                "(--max-messages)",
                "messages",
            )

    def check_tools(self, count: int) -> None:
        if count > self.max_tools:
            raise LimitError(
                f"tools has {count} tools, more than this server's limit of {self.max_tools} (--max-tools)",
                "tools",
            )

    def check_session_chunks(self, count: int) -> None:
        """``count``: the session's chunks with the new one, the opening prompt included."""
        if count > self.max_session_chunks:
            raise LimitError(
                f"the session would have {count} chunks, more than this server's limit of "
                f"{self.max_session_chunks} (--max-session-chunks)",
                "chunk",
            )


def check_prompt_chars(
    num_chars: int, max_model_len: int, max_token_chars: int, where: str = "prompt"
) -> None:
    """Raise :class:`LimitError` when a text of ``num_chars`` characters can never fit in
    ``max_model_len`` tokens (see the module docstring); cheap, so done before tokenizing."""
    bound = max_model_len * max_token_chars
    if num_chars > bound:
        raise LimitError(
            f"{where} has {num_chars} characters: it cannot fit in max_model_len ({max_model_len}) tokens of at "
            f"most {max_token_chars} characters each, so more than {bound} characters can never be served",
            where,
        )


# vLLM's cache_salt: a tenant's secret-ish name, never a payload.
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(value: Any) -> str | None:
    """``cache_salt``: None (no salt) or a non-empty string of at most
    :data:`MAX_CACHE_SALT_CHARS` characters; :class:`LimitError` naming it otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise LimitError(f"cache_salt must be a non-empty string, got {value!r:.80}", "cache_salt")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise LimitError(
            f"cache_salt has {len(value)} characters, more than {MAX_CACHE_SALT_CHARS}", "cache_salt"
        )
    return value


def check_finite(name: str, value: float) -> None:
    """Sampling floats must be finite and within float32's range (the sampler's dtype)."""
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ValueError(
            f"{name} must be a finite number within float32's range (|x| <= {FLOAT32_MAX:.7g}), got {value!r}"
        )


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    """A ``--max-...`` flag per :class:`RequestLimits` field, in a group of its own."""
    group = parser.add_argument_group("request limits (docs/serving.md; over a limit: 400/413/431 naming it)")
    for f in fields(RequestLimits):
        kind = float if f.type == "float" else int
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=kind,
            default=f.default,
            metavar=f.metadata["metavar"],
            help=f"{f.metadata['help']} (default: {f.default})",
        )


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The limits ``add_request_limit_args`` put on ``args``."""
    return RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)})
