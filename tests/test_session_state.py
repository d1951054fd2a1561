"""The frontend's bookkeeping of a streaming-input session (S15, ``frontend.session``): what it
refuses before anything reaches the engine, and when it counts as waiting for input."""

from __future__ import annotations

import pytest

from fastsched.frontend.session import SessionState, chunk_token_ids


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens, "a chunk continues the session: no BOS"
        return [ord(c) % 100 for c in text]


def test_s15_a_chunk_that_could_reach_max_model_len_is_refused_naming_the_sizes() -> None:
    state = SessionState(max_tokens_reached=90, num_input_tokens=80)
    with pytest.raises(ValueError, match=r"chunk \(6 tokens\) plus max_tokens \(4\).*100 tokens.*max_model_len \(100\)"):
        state.charge("s", 6, 4, 100)
    state.charge("s", 5, 4, 100)
    assert (state.max_tokens_reached, state.num_input_tokens, state.num_chunks) == (99, 85, 2)
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        state.charge("s", 1, 0, 1000)


def test_s15_a_session_waits_for_input_once_every_chunk_sent_is_served_and_no_close_is_coming() -> None:
    state = SessionState(max_tokens_reached=10, num_input_tokens=5)
    assert not state.waits_for_input()
    state.segment_ends.append((4, 10))
    assert state.waits_for_input()
    state.charge("s", 3, 4, 1000)  # a chunk sent: it is served before the session waits again
    assert not state.waits_for_input()
    state.segment_ends.append((8, 20))
    state.closing = True
    assert not state.waits_for_input()


def test_s15_chunk_token_ids_from_text_or_ids_and_their_errors() -> None:
    assert chunk_token_ids("ab", _Tokenizer(), 100) == [97, 98]
    assert chunk_token_ids([3, 4], _Tokenizer(), 100) == [3, 4]
    with pytest.raises(ValueError, match="at least one token"):
        chunk_token_ids([], _Tokenizer(), 100)
    with pytest.raises(ValueError, match="chunk token id 100 is out of range for a vocabulary of 100"):
        chunk_token_ids([1, 100], _Tokenizer(), 100)
