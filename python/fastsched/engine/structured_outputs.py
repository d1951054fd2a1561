"""The engine's constrained requests: one grammar matcher per request, keyed by scheduler
handle, and the token bitmask of each step's constrained rows.

A matcher advances with the tokens ``update_from_tokens`` reports, not with what the
sampler drew: those are the tokens a request keeps. A finished or aborted request's later
tokens are dropped there, and a preempted request keeps its tokens (its recomputation is a
prefill over them, nothing is sampled again), so a matcher always agrees with its request's
output and preemption needs no rollback.

A step's bitmask depends on the tokens of the step before it. Without a step in flight
(synchronous loop, or the first step of a burst) it is filled when the step is launched.
With async scheduling step N+1 is launched while step N runs, so its bitmask is filled
when N is collected (:meth:`fill`), while N+1's forward pass runs; the forward thread
waits for it only before sampling (``StepBitmask.apply``).
"""

from __future__ import annotations

import numpy as np

from fastsched._core import EngineCoreOutputs
from fastsched.model_loader.tokenizer import Tokenizer
from fastsched.structured.bitmask import StepBitmask
from fastsched.structured.matchers import StructuredOutputManager
from fastsched.structured.params import StructuredOutputsParams


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._manager: StructuredOutputManager | None = None  # built with the first constrained request
        self._constrained = np.zeros(64, dtype=bool)  # by handle
        self.num_constrained = 0

    @property
    def manager(self) -> StructuredOutputManager:
        if self._manager is None:
            self._manager = StructuredOutputManager(
                self._tokenizer.backend.to_str(), self._vocab_size, self._eos_token_ids
            )
        return self._manager

    def compile(self, params: StructuredOutputsParams) -> str:
        """The request's grammar, compiled (and cached) now so that :meth:`add` cannot fail
        once the scheduler holds the request; ``ValueError`` names what does not compile."""
        grammar = params.grammar_text()
        self.manager.compile(grammar)
        return grammar

    def add(self, handle: int, grammar: str) -> None:
        if handle >= len(self._constrained):
            grown = np.zeros(max(2 * len(self._constrained), handle + 1), dtype=bool)
            grown[: len(self._constrained)] = self._constrained
            self._constrained = grown
        self.manager.add(handle, grammar)
        self._constrained[handle] = True
        self.num_constrained += 1

    def remove(self, handles: np.ndarray) -> None:
        """Handles the scheduler reported finished (or aborted): they may be reused after this step."""
        if not self.num_constrained or not len(handles):
            return
        for h in handles[self._is_constrained(handles)].tolist():
            self.manager.remove(h)
            self._constrained[h] = False
            self.num_constrained -= 1

    def _is_constrained(self, handles: np.ndarray) -> np.ndarray:
        inside = handles < len(self._constrained)
        return inside & self._constrained[np.where(inside, handles, 0)]

    def step_bitmask(self, sampled_handles: np.ndarray, fill_now: bool) -> StepBitmask | None:
        """The bitmask of a step's constrained rows (None without any); ``fill_now`` when no
        step before it is still to be collected, else :meth:`fill` fills it when that step is collected."""
        if not self.num_constrained:
            return None
        rows = np.flatnonzero(self._is_constrained(sampled_handles))
        if not len(rows):
            return None
        bitmask = StepBitmask(rows, sampled_handles[rows])
        if fill_now:
            self.fill(bitmask)
        return bitmask

    def fill(self, bitmask: StepBitmask) -> None:
        manager = self.manager
        # A row whose matcher is gone belongs to a request that ended: its token is dropped.
        live = np.fromiter((h in manager for h in bitmask.keys.tolist()), dtype=bool, count=len(bitmask.keys))
        keys = bitmask.keys[live].tolist()
        bitmask.fill(manager.fill_bitmask(keys), bitmask.rows[live])

    def advance(self, eco: EngineCoreOutputs, following: StepBitmask | None) -> None:
        """Feeds each constrained request the tokens this step appended to it, then fills the
        bitmask of the step launched after it (``following``), if that one waits for them. A
        request that finished needs no token: its matcher is removed (and a grammar has no EOS)."""
        if not self.num_constrained and following is None:
            return
        handles = eco.handles
        offsets = eco.token_offsets
        counts = offsets[1:] - offsets[:-1]
        rows = np.flatnonzero(self._is_constrained(handles) & (eco.finish_reasons == 0) & (counts > 0))
        manager = self.manager
        tokens = eco.token_ids
        try:
            single = rows[counts[rows] == 1]  # one sampled token per row: the engine's every step
            if len(single):
                manager.accept_each(handles[single].tolist(), tokens[offsets[single]].tolist())
            for i in rows[counts[rows] > 1].tolist():
                manager.accept(int(handles[i]), tokens[offsets[i] : offsets[i + 1]].tolist())
        except BaseException:
            if following is not None:
                following.abandon()  # the forward thread must not wait for it
            raise
        if following is not None:
            self.fill(following)
