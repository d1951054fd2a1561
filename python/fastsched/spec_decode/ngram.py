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
        if length <= self.min_n:
            return np.zeros(0, dtype=np.int64)
        # matched[i]: the n tokens ending at i (i <= length - 2, so a token follows) equal the
        # last n, for n = 1, 2, ...: each longer n-gram narrows the matches of the shorter one.
        matched = np.ones(length - 1, dtype=bool)
        found: np.ndarray | None = None
        for j in range(min(self.max_n, length - 1)):
            matched[j:] &= tokens[: length - 1 - j] == tokens[length - 1 - j]
            matched[:j] = False
            if not np.count_nonzero(matched):
                break
            if j + 1 >= self.min_n:
                found = matched.copy()
        if found is None:
            return np.zeros(0, dtype=np.int64)
        start = int(np.argmax(found)) + 1
        return np.asarray(tokens[start : start + self.k], dtype=np.int64)
