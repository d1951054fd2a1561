"""Frontend admission (docs/design.md §6, A1–A5, A7): the gates a request meets before it is sent
to an engine, as a small synchronous class that needs no network.

Check and charge are one synchronous call. The frontend runs on one asyncio event
loop, so no other coroutine can run between a request's check and its charge: a burst
on one frontend can never overshoot a limit, however many requests arrive at once.

Across frontends (A6) the in-flight count is the sum of the per-frontend slots of a
``SharedAdmissionStats`` segment, read without a lock. Read-then-increment would let
the sum lag: another frontend that read it just before this one's increment landed
could admit too, so the global count could overshoot by up to K−1 requests (each with
its ``n``) for K frontends. Instead a frontend increments its own slot first and then
reads the sum (the counters are sequentially consistent), undoing its increment if the
sum is over the limit. Whichever of two racing frontends reads second sees both
increments, so the limit is never exceeded; the price is that two frontends racing at
the very edge may both back off, a rare spurious (and retryable) rejection. A rejected
request's increment is visible to other frontends for the nanoseconds before it is
undone, and no longer (A5).

The TTFT-SLO valve (``ttft_slo``) is A3 with a limit that follows the engines: the
prefill backlog a frontend may hold is ``ttft_slo × measured prefill throughput``,
shared equally by the K frontends. Until every engine has measured, the limit is a
floor of two scheduler steps' worth of prompt tokens per engine: more than a step can
take, so the engines are left backlogged, which is when they measure. Unlike A3 it counts the request's own
prompt, because that prompt's last token is what the target is about; a request alone
in the backlog is always admitted, else a prompt longer than the limit could never be
served.

The goodput valve (``tpot_slo``, A7) admits a request only if, by the model of
``frontend.slo_predictor`` fed with this frontend's own counts and the engines' measured
step time, the newcomer's TTFT stays within ``ttft_slo`` (when set) and the decoding
requests' TPOT within ``tpot_slo``; else 503 ``slo``. What it predicted is kept with the
request (``prediction``) and its error measured when the first token and the end come.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fastsched.engine.step_time_meter import StepTimeFit
from fastsched.frontend.request_metrics import Histogram
from fastsched.frontend.settings import FrontendSettings
from fastsched.frontend.slo_predictor import PromptFlow, SloPrediction, SloState, horizon, predict
from fastsched.limits import LimitError

ENGINE_FAULTED = "engine_faulted"
MAX_NUM_QUEUED_REQS = "max_num_queued_reqs"
MAX_NUM_QUEUED_TOKENS = "max_num_queued_tokens"
TTFT_SLO = "ttft_slo"
SLO = "slo"  # the goodput valve (A7)
MAX_SESSIONS = "max_sessions"  # a session over --max-sessions (frontend.session)
# The TTFT-SLO limit until measured, in scheduler steps of prompt per engine: more than
# one step's worth, so prompt tokens are left over after a step and the engines measure.
TTFT_SLO_FLOOR_STEPS = 2
REASONS = (ENGINE_FAULTED, MAX_NUM_QUEUED_REQS, MAX_NUM_QUEUED_TOKENS, TTFT_SLO, SLO, MAX_SESSIONS)
# fastsched:slo_prediction_error_seconds: |predicted − measured|, seconds. Absolute, because
# Prometheus histograms with negative buckets carry no _sum or _count.
SLO_PREDICTION_ERROR_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class AdmissionError(Exception):
    """A request refused at the door; retryable elsewhere or later (A5: gRPC UNAVAILABLE,
    HTTP 503 with Retry-After). ``reason`` is the label of ``admission_rejections_total``;
    ``limit`` and ``current`` are the numbers the message names (None for A1)."""

    reason: str = ""

    def __init__(self, message: str, *, limit: int | None = None, current: int | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.current = current


class EngineFaultedError(AdmissionError):
    """A1: fault tolerance is on and an engine is not healthy."""

    reason = ENGINE_FAULTED


class QueueOverflowError(AdmissionError):
    """A2: the requests in flight plus this one's ``n`` exceed ``max_num_queued_reqs``."""

    reason = MAX_NUM_QUEUED_REQS


class MaxQueuedTokensError(AdmissionError):
    """A3: the prompt tokens still in prefill reach ``max_num_queued_tokens``."""

    reason = MAX_NUM_QUEUED_TOKENS


class TtftSloError(AdmissionError):
    """The TTFT-SLO valve: the prompt tokens in prefill plus this request's would take
    longer than ``ttft_slo`` to drain at the engines' measured prefill throughput."""

    reason = TTFT_SLO


class SloError(AdmissionError):
    """A7, the goodput valve: the predicted TTFT or TPOT would exceed its target."""

    reason = SLO

    def __init__(self, message: str, prediction: SloPrediction) -> None:
        super().__init__(message)
        self.prediction = prediction


class SharedInFlightCounter(Protocol):
    """What admission uses of ``fastsched._core.SharedAdmissionStats`` (A6): the handle
    ``SharedAdmissionStats.open(name, frontend_index)`` returns (not the creator's, which
    has no slot). It writes only its own slot and reads the sum of all."""

    def add(self, delta: int) -> object: ...
    def set(self, value: int) -> object: ...
    def own(self) -> int: ...
    def total(self) -> int: ...


@dataclass
class _Charge:
    n: int  # sequences this request holds (A4: a parent of n holds n)
    prompt_len: int
    num_prefilling: int  # of its n sequences, those without a first token yet (A3)
    admitted_at: float = 0.0  # the controller's clock
    prediction: SloPrediction | None = None  # A7's, when it judged the request
    first_token_at: float | None = None


class AdmissionController:
    """A1–A5 for one frontend; A6 when given this frontend's shared slot.

    ``max_num_queued_reqs`` / ``max_num_queued_tokens``: None = that gate is off.
    In-flight and queued-token counts are in *sequences*: a request with ``n = 3``
    holds 3 in-flight slots and, until each of its 3 sequences has produced a token,
    3 × prompt_len queued tokens — every one of them is a prefill in an engine. It is
    checked once for all of them (A4).
    """

    def __init__(
        self,
        settings: FrontendSettings | None = None,
        shared_stats: SharedInFlightCounter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``settings``: the frontend's (validated there); its admission fields are used.
        ``clock``: seconds, for A7's prompt rate and prediction errors (the simulator's is virtual)."""
        settings = settings or FrontendSettings()
        self.ttft_slo = settings.ttft_slo
        self.tpot_slo = settings.tpot_slo
        self.clock = clock
        self.step_time: StepTimeFit | None = (
            None  # A7: the engines' mean fit; None until every one has fitted
        )
        self.token_budget = 0  # A7: one engine's max_num_batched_tokens
        self.num_engines = 1
        self._flow = PromptFlow()
        self._num_prefilling = 0  # sequences of this frontend without a first token
        self.prediction_errors = {
            target: Histogram(SLO_PREDICTION_ERROR_BUCKETS) for target in ("ttft", "tpot")
        }
        self.num_frontends = settings.num_frontends
        self.prefill_tokens_per_s: float | None = None  # the engines' total, as last reported
        self._slo_limit: int | None = None  # this frontend's share; None until the engines report
        self.max_num_queued_reqs = settings.max_num_queued_reqs
        self.max_num_queued_tokens = settings.max_num_queued_tokens
        self.fault_tolerance = settings.fault_tolerance
        self.shared_stats = shared_stats
        if shared_stats is not None:
            # This frontend has nothing in flight yet: a count left in its slot by a
            # crashed predecessor must not hold capacity forever.
            shared_stats.set(0)
        self._charges: dict[str, _Charge] = {}
        self._num_in_flight = 0
        self._num_queued_tokens = 0
        self._rejections = dict.fromkeys(REASONS, 0)

    # ------------------------------------------------------------ the gates

    def check_and_charge(
        self, request_id: str, n: int, prompt_len: int, *, engine_healthy: bool = True, max_tokens: int = 1
    ) -> None:
        """Admit the request (and charge it) or raise an :class:`AdmissionError` leaving
        no trace but the rejection counter (A5). Never awaits: see the module docstring."""
        # The request gate and the request table have judged these (an id in use, n, the prompt).
        assert request_id not in self._charges and n >= 1 and prompt_len >= 0, (request_id, n, prompt_len)
        self.check_can_ever_fit(n, prompt_len)
        if self.fault_tolerance and not engine_healthy:  # A1
            self._reject(
                EngineFaultedError(
                    "the engine is not healthy (fault tolerance is on); retry on another instance"
                )
            )
        shared = self.shared_stats
        if shared is not None:
            shared.add(n)  # increment first, then read the sum: see the module docstring
        try:
            if self.max_num_queued_reqs is not None:  # A2 (A4: n slots at once)
                in_flight = shared.total() - n if shared is not None else self._num_in_flight
                if in_flight + n > self.max_num_queued_reqs:
                    what = f"{in_flight} requests in flight" + (f" + {n} requested" if n > 1 else "")
                    self._reject(
                        QueueOverflowError(
                            f"queue full: {what} would exceed max_num_queued_reqs ({self.max_num_queued_reqs})",
                            limit=self.max_num_queued_reqs,
                            current=in_flight,
                        )
                    )
            if self.max_num_queued_tokens is not None:  # A3
                queued = self._num_queued_tokens
                if queued >= self.max_num_queued_tokens:
                    self._reject(
                        MaxQueuedTokensError(
                            f"prefill backlog full: {queued} prompt tokens queued reach "
                            f"max_num_queued_tokens ({self.max_num_queued_tokens})",
                            limit=self.max_num_queued_tokens,
                            current=queued,
                        )
                    )
            if self.ttft_slo is not None and self._slo_limit is not None:  # the TTFT-SLO valve
                queued, own = self._num_queued_tokens, n * prompt_len
                if queued > 0 and queued + own > self._slo_limit:
                    self._reject(
                        TtftSloError(
                            f"TTFT target at risk: {queued} prompt tokens queued + {own} requested would exceed "
                            f"{self._slo_limit} ({self._slo_limit_origin()})",
                            limit=self._slo_limit,
                            current=queued,
                        )
                    )
            prediction = self._check_slo(n, prompt_len, max_tokens)
        except AdmissionError:
            if shared is not None:
                shared.add(-n)  # A5: no trace
            raise
        now = self.clock()
        self._charges[request_id] = _Charge(n, prompt_len, n, now, prediction)
        self._num_in_flight += n
        self._num_prefilling += n
        self._num_queued_tokens += n * prompt_len
        if self.tpot_slo is not None:
            self._flow.add(now, n * prompt_len)

    def predict(self, n: int, prompt_len: int, max_tokens: int) -> SloPrediction | None:
        """A7's prediction for a newcomer now (None: the valve is off or the engines have
        not fitted their step time yet). This frontend's counts stand for 1/K of the
        server's, spread over the D engines."""
        if self.tpot_slo is None or self.step_time is None:
            return None
        scale = self.num_frontends / self.num_engines
        window = horizon(max_tokens, self.tpot_slo)
        state = SloState(
            num_decoding=round((self._num_in_flight - self._num_prefilling) * scale),
            num_queued_tokens=round(self._num_queued_tokens * scale),
            prompt_tokens_per_s=self._flow.rate(self.clock(), window) * scale,
            token_budget=self.token_budget,
            step=self.step_time,
        )
        return predict(state, n, prompt_len, window)

    def _check_slo(self, n: int, prompt_len: int, max_tokens: int) -> SloPrediction | None:
        """A7. A request with nothing else in flight is always admitted: the valve is
        about the load others add, and a request that is alone cannot wait for it to drop."""
        prediction = self.predict(n, prompt_len, max_tokens)
        if prediction is None or self._num_in_flight == 0:
            return prediction
        over = []
        if self.ttft_slo is not None and prediction.ttft_s > self.ttft_slo:
            over.append(f"TTFT {prediction.ttft_s:.3g} s > ttft_slo {self.ttft_slo:g} s")
        assert self.tpot_slo is not None
        if prediction.tpot_s > self.tpot_slo:
            over.append(f"TPOT {prediction.tpot_s:.3g} s > tpot_slo {self.tpot_slo:g} s")
        if over:
            self._reject(SloError(f"SLO at risk: predicted {' and '.join(over)}", prediction))
        return prediction

    def check_can_ever_fit(self, n: int, prompt_len: int) -> None:
        """A4: a request no amount of waiting can admit is a client error (``LimitError``,
        HTTP 400 naming the limit), not a retryable rejection: ``n`` above
        ``max_num_queued_reqs``, or a prompt longer than ``max_num_queued_tokens``."""
        if self.max_num_queued_reqs is not None and n > self.max_num_queued_reqs:
            raise LimitError(
                f"n is {n}, more than max_num_queued_reqs ({self.max_num_queued_reqs}): this server "
                "never has room for that many sequences of one request",
                "n",
            )
        if self.max_num_queued_tokens is not None and prompt_len > self.max_num_queued_tokens:
            raise LimitError(
                f"the prompt has {prompt_len} tokens, more than max_num_queued_tokens "
                f"({self.max_num_queued_tokens}): this server never admits a prompt that long",
                "prompt",
            )

    def mark_first_token(self, request_id: str) -> None:
        """One sequence of the request produced its first token: its prompt leaves the
        prefill backlog (A3). Call once per sequence; extra calls are no-ops."""
        charge = self._charges.get(request_id)
        if charge is not None and charge.num_prefilling > 0:
            charge.num_prefilling -= 1
            self._num_prefilling -= 1
            self._num_queued_tokens -= charge.prompt_len
            if charge.first_token_at is None:
                charge.first_token_at = self.clock()
                if charge.prediction is not None and math.isfinite(charge.prediction.ttft_s):
                    ttft = charge.first_token_at - charge.admitted_at
                    self.prediction_errors["ttft"].observe(abs(charge.prediction.ttft_s - ttft))

    def prediction(self, request_id: str) -> SloPrediction | None:
        """What A7 predicted for a request in flight (None: not judged by it, or unknown)."""
        charge = self._charges.get(request_id)
        return None if charge is None else charge.prediction

    def release(self, request_id: str, num_output_tokens: int = 0) -> None:
        """The request finished, failed or was aborted: give back everything it holds.
        Unknown (already released or never admitted) ids are a no-op. ``num_output_tokens``
        (of its first sequence) measures A7's TPOT error when there were two or more."""
        charge = self._charges.pop(request_id, None)
        if charge is None:
            return
        prediction = charge.prediction
        if (
            prediction is not None
            and math.isfinite(prediction.tpot_s)
            and charge.first_token_at is not None
            and num_output_tokens > 1
        ):  # an unbounded prediction (a request let in alone) has no error
            tpot = (self.clock() - charge.first_token_at) / (num_output_tokens - 1)
            self.prediction_errors["tpot"].observe(abs(prediction.tpot_s - tpot))
        self._num_in_flight -= charge.n
        self._num_prefilling -= charge.num_prefilling
        self._num_queued_tokens -= charge.num_prefilling * charge.prompt_len
        if self.shared_stats is not None:
            self.shared_stats.add(-charge.n)

    def update_prefill_throughput(self, tokens_per_s: float | None, floor_tokens: int) -> None:
        """The engines' latest total prefill throughput (None: not measured yet) and the
        valve's floor in tokens (``TTFT_SLO_FLOOR_STEPS`` steps' worth over all engines,
        the limit until measured): recompute this frontend's share of the TTFT-SLO limit. A no-op
        without ``ttft_slo``."""
        if self.ttft_slo is None:
            return
        self.prefill_tokens_per_s = tokens_per_s
        total = float(floor_tokens) if tokens_per_s is None else self.ttft_slo * tokens_per_s
        self._slo_limit = max(1, math.ceil(total / self.num_frontends))

    def update_step_time(self, fit: StepTimeFit | None, token_budget: int, num_engines: int) -> None:
        """A7's inputs from the engines: their mean step-time fit (None: not every engine has
        fitted yet, and the valve admits), one engine's token budget, and how many there are."""
        self.step_time, self.token_budget, self.num_engines = fit, token_budget, max(1, num_engines)

    def _slo_limit_origin(self) -> str:
        share = f" / {self.num_frontends} frontends" if self.num_frontends > 1 else ""
        if self.prefill_tokens_per_s is None:
            return f"the floor of {TTFT_SLO_FLOOR_STEPS} scheduler steps{share}, until prefill throughput is measured"
        return (
            f"ttft_slo {self.ttft_slo:g} s x measured prefill throughput "
            f"{self.prefill_tokens_per_s:.0f} tokens/s{share}"
        )

    def _reject(self, error: AdmissionError) -> None:
        self.count_rejection(error)
        raise error

    def count_rejection(self, error: AdmissionError) -> None:
        """``admission_rejections_total{reason}`` + 1, also for a refusal decided elsewhere
        (a session over ``--max-sessions``)."""
        self._rejections[error.reason] += 1

    # ------------------------------------------------------------ counters

    @property
    def num_in_flight(self) -> int:
        """Sequences admitted by this frontend and not yet released."""
        return self._num_in_flight

    @property
    def num_in_flight_total(self) -> int:
        """A2's count: the sum over all frontends' shared slots, or this frontend's own."""
        return self.shared_stats.total() if self.shared_stats is not None else self._num_in_flight

    @property
    def num_queued_tokens(self) -> int:
        """A3's count: prompt tokens of this frontend's sequences still in prefill."""
        return self._num_queued_tokens

    @property
    def queued_tokens_limit(self) -> int | None:
        """This frontend's TTFT-SLO limit on queued prompt tokens; None when the valve is
        off or the engines have not reported yet."""
        return self._slo_limit

    @property
    def num_requests(self) -> int:
        """Requests (parents) admitted and not yet released."""
        return len(self._charges)

    @property
    def rejections(self) -> dict[str, int]:
        """``admission_rejections_total{reason}``: a copy, every reason present."""
        return dict(self._rejections)
