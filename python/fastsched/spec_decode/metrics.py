"""vLLM's speculative-decoding counters (``vllm:spec_decode_*``), kept by the engine.

A *draft* is one request's proposal verified in one step; its tokens are counted in
``num_draft_tokens`` (``-1`` placeholders are not drafts), the accepted ones in
``num_accepted_tokens`` and, by position in the proposal, in ``num_accepted_tokens_per_pos``
(position 0 is accepted whenever any draft token is). Acceptance rate =
``num_accepted_tokens / num_draft_tokens``; mean acceptance length (tokens emitted per
draft) = ``1 + num_accepted_tokens / num_drafts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecDecodingCounters:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: np.ndarray, num_accepted: np.ndarray) -> None:
        """One step: per verified request, its real draft tokens and how many were accepted."""
        drafted = num_draft_tokens > 0
        self.num_drafts += int(np.count_nonzero(drafted))
        self.num_draft_tokens += int(num_draft_tokens.sum())
        accepted = num_accepted[drafted]
        self.num_accepted_tokens += int(accepted.sum())
        per_pos = np.bincount(accepted, minlength=self.num_speculative_tokens + 1)
        # A request that accepted a tokens accepted positions 0..a-1.
        at_least = np.cumsum(per_pos[::-1])[::-1]
        for pos in range(self.num_speculative_tokens):
            self.num_accepted_tokens_per_pos[pos] += int(at_least[pos + 1])

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
