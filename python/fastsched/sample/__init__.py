"""Turning a step's logits into tokens (``sampler``). Stop strings are found in text by
the frontend (``fastsched.frontend.stop``)."""

from fastsched.sample.sampler import (
    LogprobsTensors,
    PenaltyTensors,
    RowSamplingParams,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    TokenHistories,
    make_generator,
    to_device,
)

__all__ = [
    "LogprobsTensors",
    "PenaltyTensors",
    "RowSamplingParams",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "TokenHistories",
    "make_generator",
    "to_device",
]
