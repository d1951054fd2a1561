"""The tokenizer the frontend uses: a ``tokenizers.Tokenizer`` plus what a checkpoint says
around it (chat template, special tokens, EOS ids).

Built on the Rust ``tokenizers`` library rather than ``transformers.AutoTokenizer`` so a
frontend process imports neither transformers nor torch-heavy code, and the same
object serves HF directories and GGUF files.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

_GIL_FREE_ENCODE_CHARS = 4096  # texts longer than this are encoded without holding the GIL
# Appended to the message left open by ``continue_final_message``: the rendered text is cut
# where it appears, so whatever the template writes after a message is left out.
_CONTINUE_MARK = "FASTSCHED_CONTINUE_FINAL_MESSAGE "


class NoChatTemplateError(ValueError):
    """A chat was asked of a tokenizer without a chat template (a base model's): a client
    error that names how to give one."""

    def __init__(self) -> None:
        super().__init__(
            "this model's tokenizer defines no chat template (a base model has none: no "
            "tokenizer_config.json chat_template, chat_template.jinja or GGUF tokenizer.chat_template), and "
            "none was given: pass one with --chat-template FILE_OR_STRING (LLM.chat: chat_template=...), or "
            "send a plain-text prompt instead (/v1/completions, generate --raw)"
        )


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        """BOS/EOS around an encoded text come from ``backend``'s post-processor (a GGUF file's
        ``add_bos_token`` flag is turned into one, as in a Hugging Face ``tokenizer.json``)."""
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self._chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self._max_token_chars: int | None = None

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (chat template, special tokens)
        into ``directory``, as a Hugging Face tokenizer that transformers and
        ``fastsched.model_loader.load_tokenizer`` read back with the same ids."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        settings.update(
            {
                k: v
                for k, v in (
                    ("bos_token", self.bos_token),
                    ("eos_token", self.eos_token),
                    ("chat_template", self.chat_template),
                )
                if v is not None
            }
        )
        (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the longest vocabulary entry, added
        tokens included (a byte-level or sentencepiece entry is at least as long as its
        text). Bounds a prompt's length in characters before it is tokenized
        (``fastsched.limits.check_prompt_chars``)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            # encode_batch releases the GIL (encode holds it): a long text tokenized in a
            # worker thread must not stop the event loop that called it.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        """Replaces the checkpoint's template (``serve --chat-template``)."""
        self._chat_template = template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tokenize: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the checkpoint's Jinja template, or ``chat_template`` when
        given, the way transformers does (sandboxed, ``trim_blocks``/``lstrip_blocks``,
        ``raise_exception``, ``bos_token``...). :class:`NoChatTemplateError` when there is none.

        ``continue_final_message`` leaves the last message open (no end-of-turn after it), for
        the model to go on with it, as transformers does: the text is cut right after that
        message's content (after its last non-space character when the template trims it).
        When tokenizing, special tokens are not added again: the template writes them.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise NoChatTemplateError()
        compiled = _compiled_template(template)
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a last message with text content")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_MARK}]
        text = compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_kwargs,
        )
        if continue_final_message:
            at = text.rfind(_CONTINUE_MARK.strip())
            if at < 0:
                raise ValueError(
                    "continue_final_message: the chat template does not write the last message's "
                    "content, so it cannot be left open"
                )
            text = text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str) -> jinja2.Template:
    """Templates are compiled once: a server renders the same one for every chat request."""
    return _jinja_environment().from_string(template)


def _jinja_environment() -> ImmutableSandboxedEnvironment:
    # Chat templates come with downloaded checkpoints: render them sandboxed.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def resolve_chat_template(value: str) -> str:
    """``--chat-template``: a file's text when ``value`` names a file, else ``value`` itself
    when it is a Jinja template; it must compile (a clear error at start-up, not per request)."""
    try:
        is_file = Path(value).is_file()
    except OSError:  # a template can be longer than a file name may be
        is_file = False
    try:
        template = Path(value).read_text() if is_file else None
    except OSError as e:
        raise ValueError(f"--chat-template {value}: cannot read it: {e}") from None
    if template is None:
        if "{{" not in value and "{%" not in value:
            raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
        template = value
    try:
        _jinja_environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {value}: not a valid Jinja template: {e}") from None
    return template
