"""The frontend's bookkeeping of a streaming-input session (S15, ``frontend.session``) and
the request gate's checks of its chunks (``fastsched.request_gate``): what is refused before
anything reaches the engine, and when a session counts as waiting for input."""

from __future__ import annotations

import pytest

from fastsched.frontend.session import SessionState
from fastsched.limits import LimitError, RequestLimits
from fastsched.request_gate import RequestGate


class _Tokenizer:
    max_token_chars = 4

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens, "a chunk continues the session: no BOS"
        return [ord(c) % 100 for c in text]


def _gate(max_model_len: int = 100, **limits: int) -> RequestGate:
    return RequestGate(_Tokenizer(), max_model_len, 100, RequestLimits(**limits))


def test_s15_a_chunk_that_could_reach_max_model_len_is_refused_naming_the_sizes() -> None:
    gate = _gate()
    with pytest.raises(
        ValueError, match=r"chunk \(6 tokens\) plus max_tokens \(4\).*100 tokens.*max_model_len \(100\)"
    ):
        gate.chunk("s", [1] * 6, 4, False, held=90, num_chunks=1)
    chunk = gate.chunk("s", [1] * 5, 4, False, held=90, num_chunks=1)
    state = SessionState(max_tokens_reached=90, num_input_tokens=80)
    state.count(len(chunk.token_ids), chunk.max_tokens)
    assert (state.max_tokens_reached, state.num_input_tokens, state.num_chunks) == (99, 85, 2)
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        _gate(1000).chunk("s", [1], 0, False, held=0, num_chunks=1)


def test_s15_a_session_waits_for_input_once_every_chunk_sent_is_served_and_no_close_is_coming() -> None:
    state = SessionState(max_tokens_reached=10, num_input_tokens=5)
    assert not state.waits_for_input()
    state.segment_ends.append((4, 10))
    assert state.waits_for_input()
    state.count(3, 4)  # a chunk sent: it is served before the session waits again
    assert not state.waits_for_input()
    state.segment_ends.append((8, 20))
    state.closing = True
    assert not state.waits_for_input()


def test_s15_chunk_token_ids_from_text_or_ids_and_their_errors() -> None:
    gate = _gate()
    assert gate.chunk("s", "ab", 1, False, held=0, num_chunks=1).token_ids == [97, 98]
    assert gate.chunk("s", [3, 4], 1, False, held=0, num_chunks=1).token_ids == [3, 4]
    with pytest.raises(ValueError, match="at least one token"):
        gate.chunk("s", [], 1, False, held=0, num_chunks=1)
    with pytest.raises(ValueError, match="chunk token id 100 is out of range for a vocabulary of 100"):
        gate.chunk("s", [1, 100], 1, False, held=0, num_chunks=1)


def test_a_chunk_text_is_bounded_in_characters_before_it_is_tokenized() -> None:
    """Issue 22: a chunk longer than the session's room times the longest token is refused
    without being tokenized."""
    gate = _gate(100)
    with pytest.raises(LimitError, match=r"chunk has 361 characters.*more than 360") as error:
        gate.chunk("s", "x" * 361, 1, False, held=10, num_chunks=1)
    assert error.value.field == "chunk"


def test_a_session_sends_at_most_max_session_chunks() -> None:
    gate = _gate(1000, max_session_chunks=3)
    gate.chunk("s", [1], 1, False, held=0, num_chunks=2)
    with pytest.raises(LimitError, match=r"4 chunks.*limit of 3 \(--max-session-chunks\)"):
        gate.chunk("s", [1], 1, False, held=0, num_chunks=3)
