"""Replaying a request trace through the real Rust scheduler on a virtual clock.

The simulated server is one engine (one ``_core.Scheduler``) behind one frontend's
admission control (the server's own ``AdmissionController``). No model runs: each
step advances the clock by the step-cost model, and every request whose prefill is
complete gets one token that is never a stop token, so a request ends exactly at its
``output_len`` (as ``bench serve``'s ``ignore_eos`` requests do). When nothing is left
to schedule the clock jumps to the next arrival.

Timing follows the engine loop: a request that arrives while a step runs is checked by
admission at its arrival (before that step's outputs release anything) and reaches the
scheduler when the step ends. Its first token is the end of the step that completes its
prompt; it finishes at the end of the step that produces its last token.

What the steps do not contain — the HTTP, gRPC and ZMQ hops between a client and the
engine — is ``frontend_latency``: a constant, 0 by default, added to every answered
request's TTFT and end-to-end latency (and to a rejection's latency), as measured by
``fastsched bench serve`` at a load low enough for requests not to queue.

The TTFT-SLO valve (``ttft_slo``) is fed as the server feeds it: the engine's
``PrefillThroughputMeter`` observes every step as ``EngineCore.step`` does, its duration
being the modelled step cost, and after each step the admission controller gets the
meter's estimate and the floor, as ``AsyncLLM`` does on each engine message. The goodput
valve (``tpot_slo``, A7) likewise: the engine's ``StepTimeMeter`` observes every modelled
step, and admission predicts from its fit on the virtual clock, as the server does.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from fastsched import _core
from fastsched.engine.prefill_meter import PrefillThroughputMeter, prefill_tokens
from fastsched.engine.step_time_meter import StepTimeMeter
from fastsched.engine.step_trace import StepShape, StepTracer
from fastsched.frontend.admission import TTFT_SLO_FLOOR_STEPS, AdmissionController, AdmissionError
from fastsched.frontend.settings import FrontendSettings
from fastsched.limits import LimitError
from fastsched.tools.bench_report import RequestResult
from fastsched.tools.simulator.cost import StepCost
from fastsched.tools.simulator.trace import TraceRequest

SAMPLED_TOKEN = 1  # any id: requests are added without EOS and with ignore_eos


@dataclass
class _Live:
    """A request the scheduler holds: where its result goes and when its tokens came."""

    index: int  # in the trace
    request_id: str
    arrival: float  # virtual clock
    num_tokens: int  # prompt + outputs so far: a row samples once its computed tokens reach it
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass
class ReplayResult:
    """One trace replayed: what ``bench serve`` would have measured, plus the engine's side."""

    results: list[RequestResult]  # in trace order, as the client would see them
    duration_s: float  # from the trace's start to its last answer, as bench serve measures a rate
    num_steps: int
    num_preemptions: int
    num_preempted_requests: int
    wall_time_s: float  # what simulating took
    prefill_tokens_per_s: float | None = None  # the engine's meter when the trace ended (None: not measured)
    queued_tokens_limit: int | None = None  # the TTFT-SLO limit then (None: --ttft-slo off)


class Simulator:
    """One engine's scheduler and one frontend's admission on a virtual clock. Traces
    run one after another on the same scheduler (as ``bench serve``'s rates reach one
    server), so prefix-cache blocks left by one are found by the next."""

    def __init__(
        self,
        scheduler_config: _core.SchedulerConfig,
        cost: StepCost,
        *,
        max_num_queued_reqs: int | None = None,
        max_num_queued_tokens: int | None = None,
        ttft_slo: float | None = None,
        tpot_slo: float | None = None,
        frontend_latency: float = 0.0,
        step_tracer: StepTracer | None = None,
    ) -> None:
        """``step_tracer``: records every simulated step, as an engine's ``--step-trace`` does.
        ``ttft_slo``: seconds; the server's ``--ttft-slo`` valve (see ``frontend.admission``).
        ``tpot_slo``: seconds; the server's ``--tpot-slo`` goodput valve (A7)."""
        if frontend_latency < 0:
            raise ValueError(f"frontend_latency must be >= 0 seconds, got {frontend_latency}")
        self.scheduler = _core.Scheduler(scheduler_config)
        self.max_model_len = scheduler_config.max_model_len
        self.cost = cost
        self.clock = 0.0
        self.admission = AdmissionController(
            FrontendSettings(
                max_num_queued_reqs=max_num_queued_reqs,
                max_num_queued_tokens=max_num_queued_tokens,
                ttft_slo=ttft_slo,
                tpot_slo=tpot_slo,
            ),
            clock=lambda: self.clock,
        )
        self.prefill_meter = PrefillThroughputMeter()  # the engine's, as EngineCore keeps it
        self.step_time_meter = StepTimeMeter()
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.update_ttft_slo_limit()  # the floor until measured, as AsyncLLM sets it when the engine is ready
        self.frontend_latency = frontend_latency
        self.step_tracer = step_tracer
        self.num_steps = 0

    def run(
        self, trace: Sequence[TraceRequest], label: str = "trace", progress: bool = False
    ) -> ReplayResult:
        """Replays ``trace`` from the current clock until every request is answered; its
        times are relative to the clock when it starts, as bench serve's are to its first send."""
        started = time.perf_counter()
        steps_before = self.num_steps
        with tqdm(
            total=len(trace), desc=f"simulating {label}", unit="req", disable=not progress, file=sys.stderr
        ) as bar:
            replay = _Replay(self, trace, label, bar)
            replay.run()
        preempted = [n for n in replay.preemptions if n > 0]
        return ReplayResult(
            results=replay.results,
            duration_s=max((r.send_time + (r.e2e or 0.0) for r in replay.results), default=0.0),
            num_steps=self.num_steps - steps_before,
            num_preemptions=sum(preempted),
            num_preempted_requests=len(preempted),
            wall_time_s=time.perf_counter() - started,
            prefill_tokens_per_s=self.prefill_meter.tokens_per_s,
            queued_tokens_limit=self.admission.queued_tokens_limit,
        )

    def update_ttft_slo_limit(self) -> None:
        """What ``AsyncLLM._update_ttft_slo_limit`` does with this one engine's report."""
        floor = TTFT_SLO_FLOOR_STEPS * self.max_num_batched_tokens
        self.admission.update_prefill_throughput(self.prefill_meter.tokens_per_s, max(1, floor))
        self.admission.update_step_time(self.step_time_meter.fit, self.max_num_batched_tokens, 1)


class _Replay:
    """The state of one trace's replay: arrivals not yet seen, requests in the scheduler, results."""

    def __init__(self, sim: Simulator, trace: Sequence[TraceRequest], label: str, bar: tqdm) -> None:
        self.sim = sim
        self.trace = trace
        self.label = label
        self.bar = bar
        self.base = sim.clock  # the trace's time 0 on the virtual clock
        self.arrivals = deque(sorted(range(len(trace)), key=lambda i: trace[i].arrival_time))
        self.results: list[RequestResult] = [
            RequestResult(0, r.prompt_len, r.output_len, send_time=r.arrival_time) for r in trace
        ]
        self.preemptions = [0] * len(trace)
        self.live: dict[int, _Live] = {}  # by scheduler handle
        self.admitted: list[int] = []  # trace indices admitted, not yet given to the scheduler

    def run(self) -> None:
        sim, sched = self.sim, self.sim.scheduler
        while True:
            self.arrive(until=sim.clock)
            self.add_admitted()
            if not sched.has_requests():
                if not self.arrivals:
                    return
                sim.clock = max(sim.clock, self.arrival_clock(self.arrivals[0]))
                continue
            so = sched.schedule()
            backlogged = sched.num_waiting > 0  # as EngineCore.step reads it for the prefill meter
            if so.num_reqs:  # a step without rows only reports finishes: no forward pass
                sim.num_steps += 1
            if so.num_reqs == 0 and len(so.finished) == 0 and sched.num_running == 0:
                if not self.arrivals:
                    raise RuntimeError(
                        f"the scheduler cannot schedule its {sched.num_waiting} waiting requests with nothing "
                        "running (a --watermark that leaves too few blocks?)"
                    )
                sched.update_from_tokens(np.zeros(0, dtype=np.int64))
                sim.clock = max(sim.clock, self.arrival_clock(self.arrivals[0]))
                continue
            for h in so.preempted.tolist():
                self.live[h].num_preemptions += 1
            end = sim.clock + (
                sim.cost.step_time(so.total_num_scheduled_tokens, so.num_reqs) if so.num_reqs else 0.0
            )
            if sim.step_tracer is not None:
                self.trace_step(sim.step_tracer, so, end)
            self.arrive(until=end)  # admission sees them before this step's outputs
            eco = sched.update_from_tokens(self.sampled_tokens(so))
            self.measure_prefill(so, backlogged, end - sim.clock)
            sim.clock = end
            self.collect(eco)

    def sampled_tokens(self, so: _core.SchedulerOutput) -> np.ndarray:
        """One token for each row whose prompt (and recomputed outputs) are now all computed, -1 for a chunk."""
        computed = (so.num_computed_tokens.astype(np.int64) + so.num_scheduled_tokens).tolist()
        return np.array(
            [
                SAMPLED_TOKEN if n >= self.live[h].num_tokens else -1
                for h, n in zip(so.req_handles.tolist(), computed)
            ],
            dtype=np.int64,
        )

    def measure_prefill(self, so: _core.SchedulerOutput, backlogged: bool, duration: float) -> None:
        """The engine's meter observes the step (as ``EngineCore.step``), then the frontend
        gets its estimate with the step's outputs (as ``AsyncLLM``)."""
        prompt_lens = [self.trace[self.live[h].index].prompt_len for h in so.req_handles.tolist()]
        prefill, partial = prefill_tokens(so.num_scheduled_tokens, so.num_computed_tokens, prompt_lens)
        self.sim.prefill_meter.observe(prefill, duration, backlogged or partial)
        self.sim.step_time_meter.observe(so.total_num_scheduled_tokens, duration)
        self.sim.update_ttft_slo_limit()

    def trace_step(self, tracer: StepTracer, so: _core.SchedulerOutput, end: float) -> None:
        prompt_lens = np.array(
            [self.trace[self.live[h].index].prompt_len for h in so.req_handles.tolist()], dtype=np.int64
        )
        tracer.on_step(StepShape.of(so, prompt_lens), self.sim.clock, end)

    def arrival_clock(self, index: int) -> float:
        return self.base + self.trace[index].arrival_time

    def arrive(self, until: float) -> None:
        """Admission for every request arrived by ``until``, in arrival order (A2, A3)."""
        sim = self.sim
        while self.arrivals and self.arrival_clock(self.arrivals[0]) <= until:
            i = self.arrivals.popleft()
            req, result = self.trace[i], self.results[i]
            if req.prompt_len + req.output_len > sim.max_model_len:
                self.answer_error(
                    i,
                    400,
                    "invalid_request",
                    f"the prompt ({req.prompt_len} tokens) plus max_tokens ({req.output_len}) is "
                    f"longer than max_model_len ({sim.max_model_len})",
                )
                continue
            try:
                sim.admission.check_and_charge(
                    self.request_id(i), 1, req.prompt_len, max_tokens=req.output_len
                )
            except LimitError as e:  # A4: a prompt longer than max_num_queued_tokens
                self.answer_error(i, 400, "invalid_request", str(e))
                continue
            except AdmissionError as e:
                result.status, result.reason, result.e2e = 503, e.reason, sim.frontend_latency
                self.bar.update(1)
                continue
            self.admitted.append(i)

    def add_admitted(self) -> None:
        sim = self.sim
        for i in self.admitted:
            req = self.trace[i]
            request_id = self.request_id(i)
            arrival = self.arrival_clock(i)
            handle = sim.scheduler.add_request(
                request_id,
                req.prompt_token_ids,
                req.output_len,
                eos_token_id=None,
                ignore_eos=True,
                priority=req.priority,
                arrival_time=arrival,
            )
            self.live[handle] = _Live(i, request_id, arrival, req.prompt_len)
        self.admitted.clear()

    def collect(self, eco: _core.EngineCoreOutputs) -> None:
        """The step's new tokens and finishes, at the step's end."""
        sim, now = self.sim, self.sim.clock
        counts = np.diff(eco.token_offsets.astype(np.int64)).tolist()
        for h, n, reason in zip(eco.handles.tolist(), counts, eco.finish_reasons.tolist()):
            live = self.live[h]
            if n:
                if not live.token_times:
                    sim.admission.mark_first_token(live.request_id)
                live.num_tokens += n
                live.token_times.extend([now] * n)
            if reason:
                del self.live[h]
                self.finish(live, reason, h)

    def finish(self, live: _Live, reason: int, handle: int) -> None:
        sim = self.sim
        sim.admission.release(live.request_id, len(live.token_times))
        self.preemptions[live.index] = live.num_preemptions
        if _core.FINISH_REASONS.get(reason) == "ignored":
            why = sim.scheduler.ignore_reason(handle) or "the prompt can never run"
            self.answer_error(live.index, 400, "invalid_request", why)
            return
        result, latency, times = self.results[live.index], sim.frontend_latency, live.token_times
        result.status = 200
        result.output_tokens = len(times)
        result.ttft = times[0] - live.arrival + latency
        result.e2e = times[-1] - live.arrival + latency
        result.itl = [b - a for a, b in zip(times, times[1:])]
        self.bar.update(1)

    def answer_error(self, index: int, status: int, reason: str, error: str) -> None:
        result = self.results[index]
        result.status, result.reason, result.error, result.e2e = (
            status,
            reason,
            error,
            self.sim.frontend_latency,
        )
        self.bar.update(1)

    def request_id(self, index: int) -> str:
        return f"{self.label}-{index}"
