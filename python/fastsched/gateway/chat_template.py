"""A chat request's template controls (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``), as keyword arguments of ``Tokenizer.apply_chat_template``; the
same for ``/v1/chat/completions`` and ``/tokenize``, so both render a chat alike."""

from __future__ import annotations

from typing import Any

from fastsched.gateway.request_fields import FieldError, shorten

# Set by the request's own fields (or the tokenizer), never through chat_template_kwargs.
_RESERVED = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "tools",
        "bos_token",
        "eos_token",
    }
)


def template_options(body: dict) -> dict[str, Any]:
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    continue_final_message = _bool(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise FieldError(
            "continue_final_message and add_generation_prompt cannot both be true (a new turn "
            "cannot start while the last one is left open): set add_generation_prompt to false",
            "continue_final_message",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise FieldError(
            f"chat_template_kwargs must be an object, got {shorten(kwargs)}", "chat_template_kwargs"
        )
    reserved = sorted(_RESERVED & set(kwargs))
    if reserved:
        raise FieldError(
            f"chat_template_kwargs cannot set {reserved}: they have request fields (or are the "
            "tokenizer's) of their own",
            "chat_template_kwargs",
        )
    options = {**kwargs, "add_generation_prompt": add_generation_prompt}
    if continue_final_message:
        options["continue_final_message"] = True
    return options


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise FieldError(f"{name} must be a boolean, got {shorten(value)}", name)
    return value
