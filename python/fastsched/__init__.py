"""fastsched: an admission-controlled LLM inference server with a Rust per-step scheduler.

``fastsched.LLM`` and ``fastsched.SamplingParams`` are the offline API; the scheduler
binding (``fastsched._core``) is importable on its own without torch.
"""

from __future__ import annotations

from typing import Any

from fastsched._core import EngineCoreOutputs, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineCoreOutputs",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]

_LAZY = {
    "LLM": "fastsched.entrypoints.llm",
    "SamplingParams": "fastsched.sampling_params",
    "RequestOutput": "fastsched.outputs",
    "CompletionOutput": "fastsched.outputs",
}


def __getattr__(name: str) -> Any:
    """The engine API imports torch; load it only when asked for."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastsched' has no attribute {name!r}")
