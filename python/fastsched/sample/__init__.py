"""Turning a step's logits into tokens (``sampler``) and finding stop strings in text (``stop``)."""

from fastsched.sample.sampler import (
    LogprobsTensors,
    PenaltyTensors,
    RowSamplingParams,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    make_generator,
    to_device,
)
from fastsched.sample.stop import StopChecker

__all__ = [
    "LogprobsTensors",
    "PenaltyTensors",
    "RowSamplingParams",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "StopChecker",
    "make_generator",
    "to_device",
]
