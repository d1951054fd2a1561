"""``fastsched simulate``'s machinery: a step-cost model fitted on real step traces, request
traces, and a replay of a trace through the real Rust scheduler on a virtual clock.

No model runs, so comparing configs for a load takes seconds of CPU, not a GPU.
"""

from fastsched.tools.simulator.cost import StepCost, StepCostFit, fit_step_cost, read_step_trace
from fastsched.tools.simulator.replay import ReplayResult, Simulator
from fastsched.tools.simulator.trace import TraceRequest, bench_trace, load_trace

__all__ = [
    "ReplayResult",
    "Simulator",
    "StepCost",
    "StepCostFit",
    "TraceRequest",
    "bench_trace",
    "fit_step_cost",
    "load_trace",
    "read_step_trace",
]
