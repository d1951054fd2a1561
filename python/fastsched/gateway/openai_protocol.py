"""OpenAI's JSON ↔ the frontend's protobuf, for the gateway.

Parsing checks only *types* (and the protobuf integer ranges); *values* are judged by
the frontend, where ``SamplingParams.__post_init__`` is the single authority, and come
back as INVALID_ARGUMENT naming the field. Unknown fields are ignored, as vLLM does.
Limits (``fastsched.limits.RequestLimits``) are checked here too, before any work: the
prompt count, ``n``/``best_of``, stop strings, non-finite numbers, and the characters of a
prompt against what ``max_model_len`` tokens can hold (before tokenizing it).

Chat prompts are rendered *and tokenized* here with the checkpoint's chat template and
sent as token ids: the template already writes the special tokens, so the frontend
must not add a BOS again, and with the ids in hand the gateway can check
``prompt + max_tokens <= max_model_len`` and default ``max_tokens`` to the room left,
as OpenAI's chat API does. Completion prompts go as text (the frontend tokenizes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from fastsched.gateway import structured, tool_calls
from fastsched.gateway.chat_template import template_options
from fastsched.gateway.completions_echo import MIN_LOGPROB as _MIN_LOGPROB
from fastsched.gateway.completions_echo import PromptScores
from fastsched.gateway.request_fields import FieldError
from fastsched.limits import LimitError, RequestLimits, check_cache_salt, check_finite, check_prompt_chars
from fastsched.model_loader.tokenizer import NoChatTemplateError
from fastsched.proto_gen import import_stubs

pb, _ = import_stubs()
logger = logging.getLogger("fastsched.gateway")

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def check_json_content_type(content_type: str | None) -> None:
    """A JSON route's body must be declared JSON (``application/json``, or ``application/*+json``),
    or not declared at all: any other type is 415. A web page can send ``text/plain``,
    ``application/x-www-form-urlencoded`` or ``multipart/form-data`` to any address without
    asking it first (no CORS preflight); refusing them keeps a page from driving a local server."""
    if not content_type:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {_short(content_type)}.",
            code="unsupported_media_type",
        )


def bad_request(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _get_int(
    body: dict, name: str, default: int | None = None, bounds: tuple[int, int] = INT32
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {_short(value)}", name)
    if not bounds[0] <= value <= bounds[1]:
        raise bad_request(f"{name} must be in [{bounds[0]}, {bounds[1]}], got {value}", name)
    return value


def _get_float(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number, got {_short(value)}", name)
    try:
        value = float(value)
        check_finite(name, value)
    except (OverflowError, ValueError) as e:  # 1e400 parses as inf; a huge integer overflows
        raise bad_request(
            str(e) if isinstance(e, ValueError) else f"{name} is out of range, got {_short(value)}", name
        ) from None
    return value


def _get_bool(body: dict, name: str, default: bool | None = None) -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {_short(value)}", name)
    return value


def _get_int_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) or not INT32[0] <= v <= INT32[1] for v in value
    ):
        raise bad_request(f"{name} must be a list of integers, got {_short(value)}", name)
    return value


def _get_stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request(f"stop must be a string or a list of strings, got {_short(value)}", "stop")
    return value


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) and INT32[0] <= v <= INT32[1] for v in value)
    )


@dataclass
class ParsedRequest:
    """One OpenAI request, ready to become one GenerateRequest per prompt."""

    kind: Literal["completion", "chat"]
    prompts: list[str | list[int]]
    sampling: Any  # pb.SamplingParams
    priority: int
    stream: bool
    include_usage: bool
    echo: bool = False
    chat_echo: str = ""  # chat with echo: the text put before the answer
    top_logprobs: int | None = None  # the number asked for; None = no logprobs
    tool_calling: tool_calls.ToolCalling | None = None  # chat with tools
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    lora_name: str = ""  # the LoRA adapter the client named as `model`; empty: the base model
    cache_salt: str | None = None  # vLLM's: separates tenants' prefix-cache blocks
    embed: bool = False  # answer each prompt's embedding instead of generating (gateway.embeddings)

    @property
    def n(self) -> int:
        return self.sampling.n if self.sampling.HasField("n") else 1

    def grpc_requests(self) -> list[Any]:
        requests = []
        for i, prompt in enumerate(self.prompts):
            req = pb.GenerateRequest(
                request_id=f"{self.request_id}-{i}",
                sampling_params=self.sampling,
                priority=self.priority,
                model=self.lora_name,
            )
            if self.cache_salt is not None:
                req.cache_salt = self.cache_salt
            if self.embed:
                req.embed = True
            if isinstance(prompt, str):
                req.text = prompt
            else:
                req.token_ids.ids.extend(prompt)
            requests.append(req)
        return requests


def _sampling_params(body: dict, max_tokens: int | None, limits: RequestLimits) -> Any:
    stop = _get_stop(body)
    limits.check_stop(stop)
    msg = pb.SamplingParams(stop=stop, stop_token_ids=_get_int_list(body, "stop_token_ids"))
    for name in ("n", "top_k", "min_tokens"):
        if (value := _get_int(body, name)) is not None:
            setattr(msg, name, value)
    if (seed := _get_int(body, "seed", bounds=INT64)) is not None:
        msg.seed = seed
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    if (prompt_logprobs := _get_int(body, "prompt_logprobs")) is not None:  # vLLM's extra field
        msg.prompt_logprobs = prompt_logprobs
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        if (value := _get_float(body, name)) is not None:
            setattr(msg, name, value)
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if (value := _get_bool(body, name)) is not None:
            setattr(msg, name, value)
    if msg.HasField("n"):
        limits.check_n(msg.n)
    try:
        constraint = structured.structured_outputs_from_body(body)
    except FieldError as e:
        raise bad_request(str(e), e.param) from None
    if constraint is not None:
        msg.structured_outputs.CopyFrom(constraint)
    return msg


def _cache_salt(body: dict) -> str | None:
    try:
        return check_cache_salt(body.get("cache_salt"))
    except LimitError as e:
        raise bad_request(str(e), "cache_salt") from None


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(_get_bool(body, "stream", False))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {_short(options)}", "stream_options")
    include_usage = _get_bool(options, "include_usage", False)
    return stream, bool(include_usage)


# Every request field each endpoint knows (docs/openai-fields.md lists them with their status).
# A field outside these is a 400 naming it: nothing a client sends is silently ignored.
_SAMPLING_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "priority",
        "logprobs",
        "cache_salt",
        "prompt_logprobs",
        "logit_bias",  # refused when used
        *structured.FIELDS,
    }
)
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "echo",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
}
# Accepted and ignored: they do not change the output, so refusing them would only break clients.
# Each is logged once per process.
IGNORED_FIELDS = {
    "user": "an end-user id for abuse monitoring; fastsched keeps no per-user state",
}
_WARNED: set[str] = set()


def check_fields(body: dict, known: frozenset[str] | set[str]) -> None:
    """400 for a field this endpoint does not know; a log line (once) for one it ignores."""
    for name in body:
        if name in known:
            continue
        if name in IGNORED_FIELDS:
            if name not in _WARNED:
                _WARNED.add(name)
                logger.warning("request field %r is accepted and ignored: %s", name, IGNORED_FIELDS[name])
            continue
        raise bad_request(
            f"The request field `{name}` is not supported by this server "
            "(see docs/openai-fields.md for every field and its status).",
            name,
        )


def _unsupported(body: dict, name: str) -> None:
    if body.get(name):  # absent, null, [] and {} all mean "not used"
        raise bad_request(f"{name} is not supported by this server", name)


def context_length_error(prompt_len: int, max_tokens: int, max_model_len: int, where: str) -> ApiError:
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in max_tokens). "
        f"Please reduce the length of the {where} or max_tokens.",
        "max_tokens" if prompt_len < max_model_len else where,
        code="context_length_exceeded",
    )


def parse_completion(
    body: dict,
    request_id: str,
    limits: RequestLimits | None = None,
    max_model_len: int | None = None,
    tokenizer: Any = None,
) -> ParsedRequest:
    """``max_model_len`` and the ``tokenizer`` (its ``max_token_chars``), when known, bound
    each text prompt's length in characters (``fastsched.limits.check_prompt_chars``)."""
    limits = limits or RequestLimits()
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        limits.check_num_prompts(len(prompt))
        if not all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
            raise bad_request(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                f"lists of token ids, got {_short(prompt)}",
                "prompt",
            )
        prompts = list(prompt)
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            f"lists of token ids, got {_short(prompt)}",
            "prompt",
        )
    max_token_chars = getattr(tokenizer, "max_token_chars", None)
    if max_model_len is not None and max_token_chars is not None:
        for p in prompts:
            if isinstance(p, str):
                check_prompt_chars(len(p), max_model_len, max_token_chars)
    _unsupported(body, "suffix")
    _unsupported(body, "logit_bias")
    best_of = _get_int(body, "best_of")
    if best_of is not None:
        limits.check_n(best_of, "best_of")
    if best_of is not None and best_of != _get_int(body, "n", 1):
        raise bad_request("best_of other than n is not supported by this server", "best_of")
    echo = bool(_get_bool(body, "echo", False))
    logprobs = _get_int(body, "logprobs")
    max_tokens = _get_int(body, "max_tokens", 16)
    if max_tokens == 0 and not echo:  # the prompt alone: its echo (and logprobs); vLLM's rule
        raise bad_request("max_tokens must be at least 1 (0 only with echo), got 0", "max_tokens")
    sampling = _sampling_params(body, max_tokens, limits)
    if logprobs is not None:
        sampling.logprobs = logprobs
        if echo and not sampling.HasField("prompt_logprobs"):  # the legacy form scores the echoed prompt
            sampling.prompt_logprobs = logprobs
    stream, include_usage = _stream_flags(body)
    return ParsedRequest(
        "completion",
        prompts,
        sampling,
        _get_int(body, "priority", 0),
        stream,
        include_usage,
        echo=echo,
        top_logprobs=logprobs,
        request_id=request_id,
        cache_salt=_cache_salt(body),
    )


def _message_content(message: dict, i: int) -> dict:
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise bad_request(f"messages[{i}].role must be a string, got {_short(role)}", "messages")
    if isinstance(content, list):  # content parts: only text is understood
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    f"messages[{i}].content: only text parts are supported, got {_short(part)}", "messages"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise bad_request(
            f"messages[{i}].content must be a string or a list of parts, got {_short(content)}", "messages"
        )
    return {**message, "content": content if content is not None else ""}


def parse_chat(
    body: dict,
    tokenizer: Any,
    max_model_len: int | None,
    request_id: str,
    limits: RequestLimits | None = None,
    tool_parser: str | None = None,
) -> ParsedRequest:
    """Renders and tokenizes the messages: run it off the event loop for a long body. Their
    text is bounded first, as a completion prompt's (``parse_completion``). ``tool_parser``:
    the server's ``--tool-call-parser`` for ``tool_choice: "auto"``."""
    limits = limits or RequestLimits()
    check_fields(body, CHAT_FIELDS)
    if isinstance(body.get("tools"), list):
        limits.check_tools(len(body["tools"]))
    try:
        tool_calling = tool_calls.tool_calling_from_body(
            body, getattr(tokenizer, "chat_template", None), tool_parser
        )
        options = template_options(body)
    except FieldError as e:
        raise bad_request(str(e), e.param) from None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad_request(
            f"messages must be a non-empty list of message objects, got {_short(messages)}", "messages"
        )
    limits.check_messages(len(messages))
    messages = [_message_content(m, i) for i, m in enumerate(messages)]
    max_token_chars = getattr(tokenizer, "max_token_chars", None)
    if max_model_len is not None and max_token_chars is not None:
        check_prompt_chars(
            sum(len(m["content"]) for m in messages), max_model_len, max_token_chars, "messages"
        )
    if tool_calling is not None:
        options["tools"] = tool_calling.tools
    try:
        prompt_ids = list(
            tokenizer.apply_chat_template(tool_calls.template_messages(messages), tokenize=True, **options)
        )
    except NoChatTemplateError as e:  # a base model: chat needs --chat-template, completions work
        raise bad_request(str(e), "messages") from None
    except Exception as e:  # a template's raise_exception()
        raise bad_request(f"messages could not be rendered with the chat template: {e}", "messages") from e
    _unsupported(body, "logit_bias")
    max_tokens = _get_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _get_int(body, "max_tokens")
    if max_tokens == 0:
        raise bad_request("max_tokens must be at least 1 on /v1/chat/completions, got 0", "max_tokens")
    if max_model_len is not None:
        if max_tokens is None:  # OpenAI's chat default: all the room left
            max_tokens = max(max_model_len - len(prompt_ids), 0)
        if len(prompt_ids) >= max_model_len or len(prompt_ids) + max_tokens > max_model_len:
            raise context_length_error(len(prompt_ids), max_tokens, max_model_len, "messages")
    logprobs = _get_bool(body, "logprobs", False)
    top_logprobs = _get_int(body, "top_logprobs")
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    sampling = _sampling_params(body, max_tokens, limits)
    if logprobs:
        sampling.logprobs = top_logprobs or 0
    if tool_calling is not None and (forced := tool_calling.constraint()) is not None:
        if sampling.HasField("structured_outputs"):
            raise bad_request(
                f'tool_choice "{tool_calling.mode}" forces the output\'s shape: it cannot be combined '
                "with another output constraint",
                "tool_choice",
            )
        sampling.structured_outputs.CopyFrom(forced)
    if (
        tool_calling is not None
        and tool_calling.mode == "auto"
        and not sampling.HasField("skip_special_tokens")
    ):
        sampling.skip_special_tokens = (
            False  # <tool_call>, [TOOL_CALLS]...: special tokens of their vocabularies
        )
    stream, include_usage = _stream_flags(body)
    echo = bool(_get_bool(body, "echo", False))
    if echo and tool_calling is not None:
        raise bad_request("echo with tools is not supported by this server", "echo")
    return ParsedRequest(
        "chat",
        [prompt_ids],
        sampling,
        _get_int(body, "priority", 0),
        stream,
        include_usage,
        echo=echo,
        chat_echo=_chat_echo(messages, options["add_generation_prompt"]) if echo else "",
        top_logprobs=(top_logprobs or 0) if logprobs else None,
        request_id=request_id,
        tool_calling=tool_calling,
        cache_salt=_cache_salt(body),
    )


def _chat_echo(messages: list[dict], add_generation_prompt: bool) -> str:
    """What ``echo`` puts before a chat answer, as vLLM does: the last message's content when
    the answer continues its turn (the same role: assistant, or any without a new prompt)."""
    last = messages[-1]
    return last["content"] if not add_generation_prompt or last.get("role") == "assistant" else ""


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Any] = field(
        default_factory=list
    )  # formatted entries (chat) or raw positions (completion)
    text_offset: int = 0
    started: bool = False
    tool_stream: tool_calls.ToolCallStream | None = None  # chat with tools
    tool_calls: list[dict] = field(default_factory=list)


class ResponseFormatter:
    """Turns GenerateResponse deltas into OpenAI stream chunks, or into one response.

    Choices are numbered ``prompt_index * n + completion_index``, as OpenAI numbers
    the choices of a batched prompt.
    """

    def __init__(
        self, req: ParsedRequest, model: str, tokenizer: Any, prompt_tokens_details: bool = False
    ) -> None:
        self.req, self.model, self.tokenizer = req, model, tokenizer
        self.prompt_tokens_details = prompt_tokens_details  # --enable-prompt-tokens-details
        self.object = "text_completion" if req.kind == "completion" else "chat.completion"
        self.choices: dict[int, _Choice] = {}
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.prompt_scores = PromptScores(self._token_text, lambda ids: self.tokenizer.decode(ids))

    def _token_text(self, lp: Any) -> str:
        return lp.decoded_token if lp.HasField("decoded_token") else self.tokenizer.decode([lp.token_id])

    def _prompt_text(self, prompt_index: int) -> str:
        if self.req.kind == "chat":
            return self.req.chat_echo
        prompt = self.req.prompts[prompt_index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def consume(self, prompt_index: int, resp: Any) -> list[dict]:
        """Records ``resp`` and returns its choices as stream-chunk entries."""
        if resp.HasField("usage"):
            self.prompt_tokens += resp.usage.prompt_tokens
            self.completion_tokens += resp.usage.completion_tokens
            self.cached_tokens += resp.usage.cached_tokens
        self.prompt_scores.record(prompt_index, resp)
        entries = []
        for delta in resp.completions:
            index = prompt_index * self.req.n + delta.index
            choice = self.choices.setdefault(index, _Choice())
            text = delta.text
            if self.req.echo and not choice.started:
                text = self._prompt_text(prompt_index) + text
            first = not choice.started
            choice.started = True
            choice.text.append(text)
            if delta.finish_reason:
                choice.finish_reason = delta.finish_reason
                kind = delta.WhichOneof("stop_reason")
                choice.stop_reason = getattr(delta, kind) if kind else None
            logprobs = (
                self._logprobs(choice, delta, prompt_index if first and self.req.echo else None)
                if self.req.top_logprobs is not None
                else None
            )
            if self.req.kind == "completion":
                entry = {"index": index, "text": text, "logprobs": logprobs}
                if first and (scores := self.prompt_scores.vllm_field(prompt_index)) is not None:
                    entry["prompt_logprobs"] = scores
            else:
                message = {"role": "assistant", "content": text} if first else {"content": text}
                if self.req.tool_calling is not None:
                    self._tool_call_delta(choice, message, delta.finish_reason)
                entry = {"index": index, "delta": message, "logprobs": logprobs}
            entry["finish_reason"] = choice.finish_reason if delta.finish_reason else None
            entry["stop_reason"] = choice.stop_reason if delta.finish_reason else None
            entries.append(entry)
        return entries

    def _tool_call_delta(self, choice: _Choice, message: dict, finished: bool) -> None:
        """Holds back text that is (or may be) a tool call; sends calls as deltas (id and name, then
        pieces of the arguments), as vLLM does."""
        if choice.tool_stream is None:
            choice.tool_stream = tool_calls.ToolCallStream(self.req.tool_calling)
        message["content"], deltas = choice.tool_stream.feed(message["content"])
        if finished:
            rest, more, choice.finish_reason = choice.tool_stream.finish(choice.finish_reason)
            message["content"] += rest
            deltas += more
            choice.tool_calls = choice.tool_stream.calls
        if deltas:
            message["tool_calls"] = deltas

    def _logprobs(self, choice: _Choice, delta: Any, echo_prompt: int | None = None) -> dict:
        """``echo_prompt``: a completion's first delta with ``echo``: that prompt's positions come first."""
        if self.req.kind == "chat":
            content = []
            for position in delta.logprobs:
                token = self._token_text(position.sampled)
                content.append(
                    {
                        "token": token,
                        "logprob": max(position.sampled.logprob, _MIN_LOGPROB),
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {
                                "token": (t := self._token_text(lp)),
                                "logprob": max(lp.logprob, _MIN_LOGPROB),
                                "bytes": list(t.encode()),
                            }
                            for lp in position.top
                        ],
                    }
                )
            choice.logprobs.extend(content)
            return {"content": content}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        if echo_prompt is not None:
            echoed, choice.text_offset = self.prompt_scores.echo_part(echo_prompt)
            tokens, token_logprobs, top_logprobs, offsets = (
                echoed[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            )
        for position in delta.logprobs:
            token = self._token_text(position.sampled)
            tokens.append(token)
            token_logprobs.append(max(position.sampled.logprob, _MIN_LOGPROB))
            top = {self._token_text(lp): max(lp.logprob, _MIN_LOGPROB) for lp in position.top}
            top.setdefault(token, token_logprobs[-1])
            top_logprobs.append(top)
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        part = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }
        choice.logprobs.append(part)
        return part

    def usage(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.prompt_tokens_details and self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def chunk(self, entries: list[dict]) -> dict:
        body = {
            "id": self.req.request_id,
            "object": self.object + ("" if self.req.kind == "completion" else ".chunk"),
            "created": self.req.created,
            "model": self.model,
            "choices": entries,
        }
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict:
        return {**self.chunk([]), "usage": self.usage()}

    def final(self) -> dict:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text = "".join(c.text)
            logprobs = None
            if self.req.top_logprobs is not None:
                if self.req.kind == "chat":
                    logprobs = {"content": c.logprobs}
                else:
                    logprobs = {
                        key: [v for part in c.logprobs for v in part[key]]
                        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                    }
            if self.req.kind == "completion":
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "prompt_logprobs": self.prompt_scores.vllm_field(index // self.req.n),
                }
            elif c.tool_calls:
                choice = {
                    "index": index,
                    "message": {
                        "role": "assistant",
                        "content": c.tool_stream.content,
                        "tool_calls": c.tool_calls,
                    },
                    "logprobs": logprobs,
                }
            else:
                choice = {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                }
            choice.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            choices.append(choice)
        body = {
            "id": self.req.request_id,
            "object": self.object,
            "created": self.req.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.req.kind == "chat":
            body["prompt_logprobs"] = self.prompt_scores.vllm_field(0)  # vLLM's place for chat
        return body
