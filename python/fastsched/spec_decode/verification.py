"""The shape of a verification step: which logits a step computes and how its rows expand.

A request verifying ``s`` drafts computes logits at its last ``s + 1`` scheduled
positions (its real token's and each draft's), and each of them is sampled with the
request's parameters: the step's sampling rows are its requests' rows repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastsched._core import SchedulerOutput
from fastsched.sample import LogprobsTensors, SamplingMetadata
from fastsched.sample.sampler import gather_logprobs
from fastsched.spec_decode.rejection import Verified


@dataclass
class SpecStep:
    """The drafts of a step's sampled requests, in the order they sample."""

    num_drafts: np.ndarray  # [B] int64, drafts verified per sampled request (-1 placeholders included)
    draft_token_ids: np.ndarray  # [D] int64, row after row; -1: a placeholder, never accepted

    @classmethod
    def of(cls, so: SchedulerOutput, sampled_positions: np.ndarray, rows: np.ndarray) -> SpecStep:
        num_spec = so.num_spec_tokens.astype(np.int64)
        starts = np.cumsum(num_spec) - num_spec
        counts = num_spec[sampled_positions]
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return cls(counts, so.spec_token_ids[np.repeat(starts[sampled_positions], counts) + within])

    @property
    def num_positions(self) -> np.ndarray:
        """Verified positions per request: its drafts and its real token."""
        return self.num_drafts + 1

    @property
    def first_positions(self) -> np.ndarray:
        """Each request's first verified position, among all of them (the rows of the logits)."""
        return np.cumsum(self.num_positions) - self.num_positions

    @property
    def position_in_row(self) -> np.ndarray:
        """For each verified position, its index within its request's positions."""
        counts = self.num_positions
        return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)

    @property
    def num_real_drafts(self) -> np.ndarray:
        """Drafts per request without the ``-1`` placeholders."""
        row = np.repeat(np.arange(len(self.num_drafts)), self.num_drafts)
        return np.bincount(row[self.draft_token_ids >= 0], minlength=len(self.num_drafts))

    def logits_indices(self, ends: np.ndarray) -> np.ndarray:
        """Indices in the flat batch of every verified position, given each request's end (exclusive)."""
        counts = self.num_positions
        return np.repeat(ends - counts, counts) + self.position_in_row


def verification_logprobs(
    logits: torch.Tensor, metadata: SamplingMetadata, verified: Verified
) -> LogprobsTensors | None:
    """Logprobs of each request's last emitted token, at its own position (the engine gives
    no drafts to requests that ask for logprobs, so that token is their only one)."""
    if metadata.max_num_logprobs is None:
        return None
    emitted = verified.emitted_positions
    last = torch.cumsum(verified.num_accepted + 1, 0) - 1
    return gather_logprobs(
        logits[emitted].log_softmax(dim=-1), verified.token_ids[last], metadata.max_num_logprobs
    )
