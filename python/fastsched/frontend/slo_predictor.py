"""The goodput valve's model (``--tpot-slo``, docs/design.md §6 A7): from the scheduler's
state, the TTFT a newcomer would get and the TPOT the running requests (and it) would see.

One model serves the live valve (``frontend.admission``) and ``fastsched simulate``. It
reads one engine's state as the admission controller knows it — sequences decoding,
prompt tokens still in prefill, the prompt tokens admitted lately, the token budget — and
the engine's measured step time, ``t(tokens) = base + per_token × tokens``
(``engine.step_time_meter``).

TTFT. Every step carries one token per decoding sequence and fills the rest of the
budget with queued prompt (chunked prefill, first come first served), so the newcomer's
prompt, queued behind ``Q`` tokens including its own, is done after
``k = ⌈Q / (budget − decoding)⌉`` steps, which together carry ``Q + k × decoding`` tokens:
``TTFT ≈ k × base + per_token × (Q + k × decoding)``.

TPOT. A decoding sequence gets one token per step, so its TPOT is the mean step time while
it decodes. Steps are slowed by the prompt they carry: if prompt tokens arrive at ``r``
tokens/s, a step of length ``t`` carries ``r × t`` of them, so
``t = base + per_token × (decoding + r × t)``, i.e.
``TPOT ≈ (base + per_token × decoding) / (1 − per_token × r)``. ``r`` is the rate admitted
over the last horizon (the newcomer's decode life at the target TPOT) plus the newcomer's
own prompt: admitting at the rate that keeps this within target is what keeps it there,
whereas the backlog alone (the TTFT-SLO valve) says nothing of how often steps are full.
Where ``per_token × r ≥ 1`` the engine cannot keep up at all and the TPOT is unbounded.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from fastsched.engine.step_time_meter import StepTimeFit

MIN_HORIZON_S = 1.0  # the prompt-rate window: at least this, so one admission is not a rate
MAX_HORIZON_S = 30.0  # and at most this, which bounds what the flow remembers


@dataclass(frozen=True)
class SloState:
    """One engine's load as admission sees it, the newcomer not included."""

    num_decoding: int  # sequences with a first token, not finished
    num_queued_tokens: int  # prompt tokens of sequences still in prefill
    prompt_tokens_per_s: float  # prompt tokens admitted per second over the horizon
    token_budget: int  # max_num_batched_tokens
    step: StepTimeFit


@dataclass(frozen=True)
class SloPrediction:
    """What the valve predicted for one newcomer (``inf``: never, at this load)."""

    ttft_s: float
    tpot_s: float

    def as_dict(self) -> dict[str, float]:
        """JSON-safe (an unbounded prediction left out), for ``/debug/requests/{id}``."""
        return {k: v for k, v in (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s)) if math.isfinite(v)}


def predict(state: SloState, n: int, prompt_len: int, horizon_s: float) -> SloPrediction:
    """The newcomer's TTFT and the decoding sequences' TPOT if ``n`` sequences of
    ``prompt_len`` tokens are admitted now (module docstring). ``horizon_s``: the window
    ``state.prompt_tokens_per_s`` was taken over, to which the newcomer's prompt is added."""
    step = state.step
    decoding = state.num_decoding
    queued = state.num_queued_tokens + n * prompt_len
    room = state.token_budget - decoding
    if room <= 0:
        ttft = math.inf
    else:
        k = max(1, math.ceil(queued / room))
        ttft = k * step.base_s + step.per_token_s * (queued + k * decoding)
    rate = state.prompt_tokens_per_s + n * prompt_len / horizon_s
    busy = step.per_token_s * rate  # the share of engine time prompt tokens take
    # The newcomer's sequences decode too once their prompt is done.
    tpot = math.inf if busy >= 1 else step.step_time(decoding + n) / (1 - busy)
    return SloPrediction(ttft, tpot)


def horizon(max_tokens: int, tpot_slo: float) -> float:
    """The window the prompt rate is taken over: the newcomer's decode life at the target
    (``max_tokens × tpot_slo``), clamped to ``[MIN_HORIZON_S, MAX_HORIZON_S]``."""
    return min(max(max_tokens * tpot_slo, MIN_HORIZON_S), MAX_HORIZON_S)


class PromptFlow:
    """Prompt tokens admitted, with their times, over the last ``MAX_HORIZON_S``: the ``r``
    of the TPOT prediction."""

    def __init__(self) -> None:
        self._admitted: deque[tuple[float, int]] = deque()

    def add(self, now: float, tokens: int) -> None:
        self._admitted.append((now, tokens))
        while self._admitted and self._admitted[0][0] < now - MAX_HORIZON_S:
            self._admitted.popleft()

    def rate(self, now: float, window_s: float) -> float:
        """Prompt tokens per second admitted over the last ``window_s`` seconds."""
        return sum(tokens for t, tokens in self._admitted if t >= now - window_s) / window_s
