"""Stop strings, matched on detokenized text as it grows, one checker per request.

A stop string can span token boundaries, so it is searched for in the text, not in
tokens.  The output ends before the stop string (after it with
``include_stop_str_in_output``).  A stream must not show text it may later have to
take back, so while the output ends in a proper prefix of some stop string those
characters are held back (at most ``len(longest stop) - 1`` of them).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Finds the first stop string in one request's output and says what may be streamed."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""  # the output so far, cut at the stop string once one matched
        self.matched_stop: str | None = None
        self._num_emitted = 0
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    @property
    def stopped(self) -> bool:
        return self.matched_stop is not None

    def append(self, delta: str, check: bool = True) -> str:
        """Add newly detokenized text; return the text that may be streamed now.

        ``check=False`` adds text without looking for stop strings in it (vLLM does
        not stop on a string before ``min_tokens`` are out); later checks only look
        at text added after it.  After a match the request is finished: the caller
        stops generating and must not append again.
        """
        if self.stopped:
            raise RuntimeError(f"append after the output already stopped at {self.matched_stop!r}")
        previous_len = len(self.text)
        self.text += delta
        match = self._find_stop(previous_len) if check else None
        if match is None:
            return self._release(len(self.text) - self._num_held_back())
        start, stop = match
        self.text = self.text[: start + len(stop) if self.include_stop_str_in_output else start]
        self.matched_stop = stop
        return self._release(len(self.text))

    def flush(self) -> str:
        """Release the held-back text when the request ends for another reason (EOS, max_tokens)."""
        return self._release(len(self.text))

    def _find_stop(self, previous_len: int) -> tuple[int, str] | None:
        """The stop string that completes first in the new text, as (start, stop).

        Only matches ending after ``previous_len`` are new; earlier text was checked.
        Of two matches, the one ending first wins: generating token by token, it is
        the one that would have stopped the request.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            start = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        if self.include_stop_str_in_output:
            return 0  # the stop string is shown anyway, so nothing needs taking back
        for length in range(min(self._max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self._num_emitted)
        released = self.text[self._num_emitted : upto]
        self._num_emitted = upto
        return released
