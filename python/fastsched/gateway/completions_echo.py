"""Prompt logprobs in the OpenAI API: the legacy completions form (``echo: true`` with
``logprobs: k``, the prompt's tokens, offsets and logprobs before the output's, ``null`` for
the first token) that evaluation harnesses score with, and vLLM's ``prompt_logprobs`` field.

A ``GenerateResponse`` carries a prompt's logprobs once (``prompt_logprobs`` and
``prompt_token_ids``, docs of the proto); :class:`PromptScores` keeps them per prompt of a
request, for every choice of that prompt to start with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# OpenAI's legacy logprobs floor: -inf (a token the model rules out) is not JSON.
MIN_LOGPROB = -9999.0


def prompt_logprobs_from(resp: Any, token_text: Callable[[Any], str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token ``null`` or ``{token_id: {logprob, rank,
    decoded_token}}``, the prompt token and its most likely alternatives."""
    out: list[dict | None] = []
    for position in resp.prompt_logprobs:
        if not position.HasField("sampled"):
            out.append(None)
            continue
        entry: dict[str, dict[str, Any]] = {}
        for lp in (position.sampled, *position.top):
            entry.setdefault(
                str(lp.token_id),
                {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank, "decoded_token": token_text(lp)},
            )
        out.append(entry)
    return out


class PromptScores:
    """The prompt logprobs of each prompt of a request, as they arrive."""

    def __init__(self, token_text: Callable[[Any], str], decode: Callable[[list[int]], str]) -> None:
        self._token_text = token_text
        self._decode = decode
        self._responses: dict[int, Any] = {}

    def record(self, prompt_index: int, resp: Any) -> None:
        if len(resp.prompt_logprobs):
            self._responses[prompt_index] = resp

    def vllm_field(self, prompt_index: int) -> list[dict | None] | None:
        """The prompt's ``prompt_logprobs`` (vLLM's field), None while not known."""
        resp = self._responses.get(prompt_index)
        return None if resp is None else prompt_logprobs_from(resp, self._token_text)

    def echo_part(self, prompt_index: int) -> tuple[dict, int]:
        """The prompt's positions in OpenAI's legacy logprobs form, and the length of their
        text (where the output's offsets start). ``ValueError`` if they are not known."""
        resp = self._responses.get(prompt_index)
        if resp is None:
            raise ValueError(f"prompt {prompt_index}: the engine returned no prompt logprobs")
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = 0
        for token_id, position in zip(resp.prompt_token_ids, resp.prompt_logprobs):
            token = self._decode([token_id])
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            if not position.HasField("sampled"):
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            value = max(position.sampled.logprob, MIN_LOGPROB)
            token_logprobs.append(value)
            top = {self._token_text(lp): max(lp.logprob, MIN_LOGPROB) for lp in position.top}
            top.setdefault(token, value)
            top_logprobs.append(top)
        part = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }
        return part, offset
