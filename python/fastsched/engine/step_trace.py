"""``--step-trace``: one JSON line per engine step, the data a step-cost model is fitted on.

A line holds the step's shape and how long it took::

    {"time": 1718000000.123, "batched_tokens": 272, "running_reqs": 17,
     "prefill_tokens": 256, "prefill_reqs": 1, "duration_s": 0.0123}

``time`` is the wall-clock start of the step; ``batched_tokens`` the tokens scheduled
(the forward pass's width); ``running_reqs`` the rows of the batch; ``prefill_*`` the
rows still computing their prompt (or recomputing it after a preemption) and their
tokens. ``fastsched bench fit-step-cost`` fits ``duration_s ≈ a + b·batched_tokens +
c·running_reqs`` over the lines, and ``fastsched simulate`` replays traffic with that fit.

What ``duration_s`` covers depends on who drives the steps. By default it is the
``EngineCore.step()`` call (schedule, forward pass, update): what an offline run
(``fastsched.LLM``, ``fastsched bench steps``) spends per step. The engine process
switches to *cycle timing* (:meth:`StepTracer.use_cycle_timing`): a step lasts from its
start to the start of the next one while the loop stays busy, so output sending and
input draining, which a served step pays too, are counted; the last step before the
loop goes idle ends when the loop goes idle (:meth:`StepTracer.on_idle`), so idle time
never is. A step that schedules no row (it only reports aborts) runs no forward pass
and is not recorded. A step still waiting for its end when the process exits
without :meth:`StepTracer.close` is dropped.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from dataclasses import asdict, dataclass

import numpy as np

from fastsched._core import SchedulerOutput

FLUSH_LINES = 256  # lines buffered before a write (~30 KB)


@dataclass(frozen=True)
class StepShape:
    """What a step computed, the cost model's inputs and two more for analysis."""

    batched_tokens: int
    running_reqs: int
    prefill_tokens: int
    prefill_reqs: int

    @classmethod
    def of(cls, so: SchedulerOutput, prompt_lens: np.ndarray) -> StepShape:
        """``prompt_lens``: the prompt length of each scheduled row, in ``so``'s order.

        A row is a decode when it computes one token (plus its drafts) past its prompt;
        every other row computes prompt tokens, or recomputes them after a preemption.
        """
        scheduled = so.num_scheduled_tokens.astype(np.int64)
        decode = (scheduled == 1 + so.num_spec_tokens.astype(np.int64)) & (
            so.num_computed_tokens >= prompt_lens
        )
        return cls(
            batched_tokens=int(scheduled.sum()),
            running_reqs=len(scheduled),
            prefill_tokens=int(scheduled[~decode].sum()),
            prefill_reqs=int((~decode).sum()),
        )


class StepTracer:
    """Appends one JSON line per step to ``path``. Lines are buffered and written in
    whole-line chunks by single ``O_APPEND`` writes, so engines of a data-parallel
    server may share one file; :meth:`close`, or the interpreter's exit, writes the rest."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lines: list[str] = []
        self._flush_at_exit = weakref.finalize(self, _flush_and_close, self._fd, self._lines)
        self._cycle_timing = False
        # Cycle timing: the step still waiting for its end: (shape, start, end of its step() call).
        self._pending: tuple[StepShape, float, float] | None = None

    def use_cycle_timing(self) -> None:
        """Time a step until the next one starts (the engine loop's view); see the module docstring."""
        self._cycle_timing = True

    def on_step(self, shape: StepShape, start: float, end: float) -> None:
        """A step ran from ``start`` to ``end`` (its ``EngineCore.step()`` call), ``time.time()`` seconds."""
        if self._pending is not None:
            self._write_pending(start)
        if shape.running_reqs == 0:
            return
        if self._cycle_timing:
            self._pending = (shape, start, end)
        else:
            self._write(shape, start, end - start)

    def on_idle(self) -> None:
        """The loop has nothing to do and is about to wait: the last step ends now."""
        if self._pending is not None:
            self._write_pending(time.time())

    def close(self) -> None:
        """Writes a step still pending (timed to the end of its call), the buffer, and closes the file."""
        if self._pending is not None:
            self._write_pending(self._pending[2])
        self._flush_at_exit()

    def _write_pending(self, end: float) -> None:
        assert self._pending is not None
        shape, start, _ = self._pending
        self._pending = None
        self._write(shape, start, end - start)

    def _write(self, shape: StepShape, start: float, duration: float) -> None:
        line = {"time": round(start, 6), **asdict(shape), "duration_s": round(duration, 9)}
        self._lines.append(json.dumps(line, separators=(",", ":")) + "\n")
        if len(self._lines) >= FLUSH_LINES:
            _flush(self._fd, self._lines)


def _flush(fd: int, lines: list[str]) -> None:
    if lines:
        os.write(fd, "".join(lines).encode())
        lines.clear()


def _flush_and_close(fd: int, lines: list[str]) -> None:
    _flush(fd, lines)
    os.close(fd)
