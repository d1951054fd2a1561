"""Per-request sampling parameters, with vLLM's names, defaults and meanings.

Clients already speak vLLM's (and OpenAI's) vocabulary, so a request's JSON maps
onto this dataclass field for field.  Every rule about which values are allowed
lives in ``__post_init__``; the sampler and the stop checker trust what they get.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from fastsched.limits import check_finite
from fastsched.structured.params import StructuredOutputsParams, check_compiles

# Below this a temperature means greedy: dividing logits by it would overflow fp32.
GREEDY_TEMPERATURE_EPS = 1e-5
# vLLM's default ``max_logprobs``: top-k logprobs are gathered for the whole batch at
# the largest k requested, so one request must not make every step expensive.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    ``stop`` accepts a single string, a list or ``None`` and is normalised to a
    list; ``stop_token_ids`` accepts ``None`` likewise.  ``top_k`` of 0 or -1
    disables top-k.  ``logprobs=0`` returns only the sampled token's logprob.
    ``max_tokens=0`` asks for no output: the request ends once its prompt is computed
    (S20), e.g. to score it with ``prompt_logprobs``. ``prompt_logprobs=k`` returns, for
    every prompt token but the first, its logprob and rank and its ``k`` most likely
    alternatives (vLLM's); it sets ``skip_reading_prefix_cache`` unless that is given, so
    that no position is taken from the prefix cache unscored (S19).
    ``structured_outputs`` (a :class:`StructuredOutputsParams` or a map of its fields)
    constrains the output to a JSON schema, a regex, a choice or a grammar; the output then
    ends where the grammar does (finish reason ``stop``), even with ``ignore_eos``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # None: True exactly when prompt_logprobs is set (vLLM's default), decided in __post_init__.
    skip_reading_prefix_cache: bool | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if "" in stops:
            raise ValueError(f"stop must not contain an empty string, got {stops!r}")
        self.stop = stops
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        self._validate()

    def _validate(self) -> None:
        # Infinity (JSON's 1e400, gRPC doubles) or anything beyond float32 would reach the
        # sampler as inf, where -inf logits (min_tokens, top-k) divided by it become NaN.
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            check_finite(name, getattr(self, name))
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not self.temperature >= 0.0:  # `not >=` also rejects NaN
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be non-negative, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.structured_outputs is not None:
            if self.min_tokens:
                # min_tokens bans the EOS that a complete grammar leaves as the only token.
                raise ValueError(
                    f"min_tokens must be 0 with structured_outputs (the grammar decides where the "
                    f"output ends), got {self.min_tokens}"
                )
            check_compiles(self.structured_outputs)

    @property
    def is_greedy(self) -> bool:
        """Greedy rows take the argmax and never draw from a generator."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def clone(self) -> SamplingParams:
        """A deep copy, so that a request's parameters can be changed (e.g. per ``n`` child) alone."""
        return copy.deepcopy(self)
