"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes, served
from the gateway's own tokenizer (the model's, as the frontends use it).

``/tokenize`` takes a completion prompt (``prompt``) or chat ``messages`` (rendered with
the model's chat template, as ``/v1/chat/completions`` renders them); ``/detokenize``
takes ``tokens``. A field this server does not implement is a 400 naming it, never
silently ignored.
"""

from __future__ import annotations

from typing import Any

from fastsched.gateway.chat_template import template_options
from fastsched.gateway.openai_protocol import bad_request
from fastsched.gateway.request_fields import FieldError
from fastsched.limits import RequestLimits, check_prompt_chars
from fastsched.model_loader.tokenizer import NoChatTemplateError

_COMMON = {"model"}
_PROMPT_FIELDS = _COMMON | {"prompt", "add_special_tokens", "return_token_strs"}
_CHAT_FIELDS = _COMMON | {
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "return_token_strs",
    "chat_template_kwargs",
}
_DETOKENIZE_FIELDS = _COMMON | {"tokens"}


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(
            f"This server does not support the field(s) {unknown} here; supported: {sorted(allowed)}.",
            unknown[0],
        )


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {value!r}", name)
    return value


def tokenize(
    body: dict[str, Any], tokenizer: Any, max_model_len: int | None, limits: RequestLimits
) -> dict[str, Any]:
    """The ``/tokenize`` response for ``body``: ``count``, ``max_model_len``, ``tokens``,
    ``token_strs`` (with ``return_token_strs``, else null)."""
    if "messages" in body:
        _check_fields(body, _CHAT_FIELDS)
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("messages must be a non-empty list of message objects", "messages")
        limits.check_messages(len(messages))
        try:
            options = template_options(body)
        except FieldError as e:
            raise bad_request(str(e), e.param) from None
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        except NoChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        except (ValueError, TypeError) as e:
            raise bad_request(f"The chat template cannot render these messages: {e}", "messages") from None
        # The template writes the special tokens itself (as /v1/chat/completions tokenizes).
        add_special = _bool(body, "add_special_tokens", False)
    elif "prompt" in body:
        _check_fields(body, _PROMPT_FIELDS)
        text = body["prompt"]
        if not isinstance(text, str):
            raise bad_request(f"prompt must be a string, got {type(text).__name__}", "prompt")
        add_special = _bool(body, "add_special_tokens", True)
    else:
        raise bad_request("Give `prompt` (a string) or `messages` (a chat).", "prompt")
    if max_model_len is not None:
        check_prompt_chars(
            len(text),
            max_model_len,
            tokenizer.max_token_chars,
            "messages" if "messages" in body else "prompt",
        )
    tokens = tokenizer.encode(text, add_special_tokens=add_special)
    token_strs = None
    if _bool(body, "return_token_strs", False):
        token_strs = [tokenizer.backend.id_to_token(t) for t in tokens]
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}


def detokenize(body: dict[str, Any], tokenizer: Any, vocab_size: int | None) -> dict[str, Any]:
    """The ``/detokenize`` response for ``body``: ``{"prompt": text}``."""
    _check_fields(body, _DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise bad_request("tokens must be a list of token ids (integers)", "tokens")
    bound = vocab_size if vocab_size is not None else tokenizer.vocab_size
    bad = next((t for t in tokens if not 0 <= t < bound), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range for a vocabulary of {bound}", "tokens")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}
