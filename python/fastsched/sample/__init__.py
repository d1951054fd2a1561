"""Turning a step's logits into tokens (``sampler``). Stop strings are found in text by
the frontend (``fastsched.frontend.stop``)."""

from fastsched.sample.sampler import (
    LogprobsTensors,
    PenaltyTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    make_generator,
)

__all__ = [
    "LogprobsTensors",
    "PenaltyTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "make_generator",
]
