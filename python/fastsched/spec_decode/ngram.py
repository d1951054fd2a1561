"""N-gram prompt lookup: drafts copied from where the sequence's last n tokens occurred before.

No second model: a request that repeats or edits text it was given (code edits,
summaries that quote, templated output) continues the way its earlier occurrence
did. As vLLM's ``NgramProposer``: the longest n in ``[prompt_lookup_min,
prompt_lookup_max]`` whose last-n-token suffix occurs earlier wins, and its first
occurrence gives the ``k`` tokens that followed it (fewer near the end, none without
a match).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Drafts (int64, at most ``k``) for each token sequence (prompt and outputs so far)."""
        return [self.propose_one(tokens) for tokens in sequences]

    def propose_one(self, tokens: np.ndarray) -> np.ndarray:
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that start early enough to be followed by at least one token.
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return np.asarray(tokens[start : start + self.k], dtype=np.int64)
        return np.zeros(0, dtype=np.int64)
