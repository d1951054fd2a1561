"""A step's outputs as columns (``protocol.OutputBatch``): what the engine builds, what
an OUTPUTS message carries, and how the frontend gets one ``EngineCoreOutput`` per row."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest

from fastsched.engine import protocol
from fastsched.engine.protocol import EngineCoreOutput, EngineStats, OutputBatch
from fastsched.sampling_params import SamplingParams

OUTPUTS = [
    EngineCoreOutput("a", [5, 6], None, num_cached_tokens=16),
    EngineCoreOutput("b", [7], "stop", 7, [{7: (-0.5, 1), 9: (-1.5, 2)}]),
    EngineCoreOutput("c", [], "ignored", error="prompt too long"),
    EngineCoreOutput("d", [8, 9, 10], "length"),
    EngineCoreOutput("e", [11], None, segment_ended=True),
]


def test_iterating_a_batch_gives_back_its_outputs() -> None:
    assert list(OutputBatch.from_outputs(OUTPUTS)) == OUTPUTS
    assert list(OutputBatch.empty()) == [] and len(OutputBatch.empty()) == 0


def test_an_outputs_message_carries_the_columns_and_decodes_to_outputs() -> None:
    timings = [protocol.RequestTiming("b", 0.1, 0.2, 0.3)]
    for outputs in (OUTPUTS, OutputBatch.from_outputs(OUTPUTS)):
        msg = protocol.decode(
            protocol.encode(protocol.Outputs(3, outputs, EngineStats(num_running=2), timings))
        )
        assert msg == protocol.Outputs(3, OUTPUTS, EngineStats(num_running=2), timings)


def test_select_keeps_the_rows_and_their_extras() -> None:
    batch = OutputBatch.from_outputs(OUTPUTS)
    assert list(batch.select(np.array([1, 3]))) == [OUTPUTS[1], OUTPUTS[3]]
    assert list(batch.select(np.array([0, 2]))) == [OUTPUTS[0], OUTPUTS[2]]
    assert list(batch.select(np.array([3, 4]))) == [OUTPUTS[3], OUTPUTS[4]]
    assert list(batch.select(np.array([], dtype=np.int64))) == []


def columns(**changes: object) -> list[object]:
    wire = msgspec.msgpack.decode(
        msgspec.msgpack.encode(protocol.OutputColumns.of(OutputBatch.from_outputs(OUTPUTS)))
    )
    names = [
        "request_ids",
        "token_offsets",
        "token_ids",
        "finish_reasons",
        "num_cached_tokens",
        "extras",
        "segment_ends",
    ]
    for name, value in changes.items():
        wire[names.index(name)] = value
    return wire


@pytest.mark.parametrize(
    "bad",
    [
        columns(token_offsets=np.array([0, 2, 3], dtype="<u4").tobytes()),  # one entry short
        columns(token_offsets=np.array([0, 3, 2, 2, 6], dtype="<u4").tobytes()),  # decreasing
        columns(token_ids=b"\x01\x02\x03"),  # not whole uint32 values
        columns(finish_reasons=bytes([0, 1, 9, 2, 0])),  # unknown code
        columns(num_cached_tokens=np.array([-2, 0, 0, 0, 0], dtype="<i8").tobytes()),
        columns(extras=[[7, None, None, None]]),  # row out of range
        columns(request_ids=["a", "b"]),  # fewer ids than rows
        columns(segment_ends=[5]),  # row out of range
        columns()[:6],  # a column missing
    ],
)
def test_malformed_columns_are_a_protocol_error(bad: list[object]) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(msgpack.packb(["outputs", 0, bad, {}, []], use_bin_type=True))


@pytest.mark.parametrize(
    "msg",
    [
        protocol.Pause("paused_all", 7, 1),
        protocol.Paused(2, 7, "unpaused"),
        protocol.StreamInput("s", [1, 2, 3], 16, is_last=True),
        protocol.CloseStream("s"),
        protocol.ReloadWeights("/ckpt", 3, 0),
        protocol.Reloaded(1, 3, None),
        protocol.Reloaded(1, 3, (protocol.RELOAD_CONFLICT, "the engine is unpaused")),
        protocol.ResetPrefixCache(4, 1),
        protocol.PrefixCacheReset(0, 4),
        protocol.AddRequest(
            protocol.EngineCoreRequest(
                "s", [4, 5], SamplingParams(max_tokens=3), arrival_time=1.0, streaming=True
            ),
            0,
        ),
    ],
)
def test_s13_s15_pause_reload_and_session_messages_round_trip(msg: protocol.Message) -> None:
    assert protocol.decode(protocol.encode(msg)) == msg


@pytest.mark.parametrize(
    "wire",
    [
        ["pause", "paused_some", 1, 0],
        ["paused", 0, 1, "sleeping"],
        ["stream_input", "s", [1], -1, False],
        ["stream_input", "s", [1], 4, "yes"],
        ["close_stream", 5],
        ["reloaded", 0, 1, ["broken", "why"]],
        ["reload_weights", None, 1, 0],
        ["reset_prefix_cache", -1, 0],
        ["prefix_cache_reset", 0],
    ],
)
def test_s13_s15_malformed_pause_reload_and_session_messages_are_protocol_errors(wire: list[object]) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(msgpack.packb(wire, use_bin_type=True))


def test_s8_kv_events_round_trip_as_uint64_columns() -> None:
    """KV_EVENTS (``--routing prefix``): hashes cached and evicted, as little-endian uint64 bytes."""
    stored, removed = np.array([1, 2**64 - 1], dtype=np.uint64), np.array([7], dtype=np.uint64)
    msg = protocol.decode(
        protocol.encode(protocol.KvEvents(1, stored.astype("<u8").tobytes(), removed.astype("<u8").tobytes()))
    )
    assert isinstance(msg, protocol.KvEvents) and msg.engine_index == 1
    got = msg.hashes()
    assert got[0].tolist() == [1, 2**64 - 1] and got[1].tolist() == [7]
    with pytest.raises(ValueError, match="stored must be a whole number of 8-byte values"):
        protocol.KvEvents(0, b"\x01\x02", b"").hashes()


def test_a_row_with_an_embedding_and_prompt_logprobs_round_trips() -> None:
    """OutputExtra's two optional fields (``pooled``, then ``prompt_logprobs``), alone and together."""
    vector = np.array([0.6, -0.8], dtype=np.float32)
    prompt = [None, {4: (-0.25, 1)}, {9: (-2.0, 3), 4: (-1.0, 1)}]
    outputs = [
        EngineCoreOutput("p", [], "length", pooled=vector),
        EngineCoreOutput("q", [3], None, prompt_logprobs=prompt),
        EngineCoreOutput("r", [], "length", pooled=vector, prompt_logprobs=prompt),
    ]
    batch = OutputBatch.from_outputs(outputs)
    got = list(protocol.decode(protocol.encode(protocol.Outputs(0, batch, EngineStats(), []))).outputs)
    assert [(o.request_id, o.prompt_logprobs) for o in got] == [("p", None), ("q", prompt), ("r", prompt)]
    assert got[1].pooled is None
    for o in (got[0], got[2]):
        assert o.pooled is not None and o.pooled.dtype == np.float32
        np.testing.assert_array_equal(o.pooled, vector)
