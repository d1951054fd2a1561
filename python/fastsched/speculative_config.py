"""``--speculative-config``: vLLM's JSON for speculative decoding, parsed and checked once.

Two drafters are supported, with vLLM's spelling:

- ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}``:
  prompt lookup, drafts copied from an earlier occurrence of the sequence's last n-gram;
- ``{"model": PATH, "num_speculative_tokens": k}``: a small draft model of the same vocabulary
  (``"method": "draft_model"`` may be given; it is implied by ``model``).

Kept free of torch so that reading flags stays cheap (frontends and the gateway parse them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastsched.json_flags import json_object

METHODS = ("ngram", "draft_model")
_KNOWN_FIELDS = frozenset(
    {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed; ``num_speculative_tokens`` (``k``) drafts per request per step at most."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int
    model: str | None = None  # draft_model only
    prompt_lookup_min: int = 1  # ngram only: shortest n-gram matched
    prompt_lookup_max: int = 3  # ngram only: longest n-gram matched (tried first)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(METHODS)}; got {self.method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model is required for a draft model")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model cannot be set with method 'ngram'")
            if self.prompt_lookup_min < 1:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min must be at least 1, got {self.prompt_lookup_min}"
                )
            if self.prompt_lookup_max < self.prompt_lookup_min:
                raise ValueError(
                    f"speculative_config.prompt_lookup_max ({self.prompt_lookup_max}) must be at "
                    f"least prompt_lookup_min ({self.prompt_lookup_min})"
                )


def parse_speculative_config(value: str | Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
    """A JSON string (the flag) or a dict (``LLM(speculative_config={...})``) as a
    :class:`SpeculativeConfig`; ``ValueError`` names the bad field or value."""
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        value = json_object(value, "speculative_config")
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _KNOWN_FIELDS)
    if unknown:
        raise ValueError(
            f"speculative_config has unsupported fields: {', '.join(unknown)} "
            f"(supported: {', '.join(sorted(_KNOWN_FIELDS))})"
        )
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config.num_speculative_tokens is required")
    method = value.get("method") or ("draft_model" if value.get("model") else None)
    if method is None:
        raise ValueError("speculative_config needs a method ('ngram') or a draft model ('model')")
    ints = {
        name: value[name]
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
        if name in value
    }
    for name, v in ints.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"speculative_config.{name} must be an integer, got {v!r}")
    if method == "draft_model" and ("prompt_lookup_min" in ints or "prompt_lookup_max" in ints):
        raise ValueError("speculative_config.prompt_lookup_min/max apply to method 'ngram' only")
    # One bound given: the other takes its value (as vLLM does).
    if "prompt_lookup_min" in ints and "prompt_lookup_max" not in ints:
        ints["prompt_lookup_max"] = ints["prompt_lookup_min"]
    if "prompt_lookup_max" in ints and "prompt_lookup_min" not in ints:
        ints["prompt_lookup_min"] = ints["prompt_lookup_max"]
    model = value.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"speculative_config.model must be a path, got {model!r}")
    return SpeculativeConfig(method=method, model=model, **ints)
