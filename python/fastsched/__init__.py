"""fastsched: an admission-controlled LLM inference server with a Rust per-step scheduler."""

from fastsched._core import EngineCoreOutputs, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["EngineCoreOutputs", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
