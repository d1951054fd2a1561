"""A step's outputs as columns (``protocol.OutputBatch``): what the engine builds, what
an OUTPUTS message carries, and how the frontend gets one ``EngineCoreOutput`` per row."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from fastsched.engine import protocol
from fastsched.engine.protocol import EngineCoreOutput, EngineStats, OutputBatch

OUTPUTS = [
    EngineCoreOutput("a", [5, 6], None, num_cached_tokens=16),
    EngineCoreOutput("b", [7], "stop", 7, [{7: (-0.5, 1), 9: (-1.5, 2)}]),
    EngineCoreOutput("c", [], "ignored", error="prompt too long"),
    EngineCoreOutput("d", [8, 9, 10], "length"),
]


def test_iterating_a_batch_gives_back_its_outputs() -> None:
    assert list(OutputBatch.from_outputs(OUTPUTS)) == OUTPUTS
    assert list(OutputBatch.empty()) == [] and len(OutputBatch.empty()) == 0


def test_an_outputs_message_carries_the_columns_and_decodes_to_outputs() -> None:
    timings = [protocol.RequestTiming("b", 0.1, 0.2, 0.3)]
    for outputs in (OUTPUTS, OutputBatch.from_outputs(OUTPUTS)):
        msg = protocol.decode(protocol.encode(protocol.Outputs(3, outputs, EngineStats(num_running=2), timings)))
        assert msg == protocol.Outputs(3, OUTPUTS, EngineStats(num_running=2), timings)


def test_select_keeps_the_rows_and_their_extras() -> None:
    batch = OutputBatch.from_outputs(OUTPUTS)
    assert list(batch.select(np.array([1, 3]))) == [OUTPUTS[1], OUTPUTS[3]]
    assert list(batch.select(np.array([0, 2]))) == [OUTPUTS[0], OUTPUTS[2]]
    assert list(batch.select(np.array([], dtype=np.int64))) == []


def columns(**changes: object) -> list[object]:
    wire = protocol._batch_to_wire(OutputBatch.from_outputs(OUTPUTS))
    names = ["request_ids", "token_offsets", "token_ids", "finish_reasons", "num_cached_tokens", "extras"]
    for name, value in changes.items():
        wire[names.index(name)] = value
    return wire


@pytest.mark.parametrize("bad", [
    columns(token_offsets=np.array([0, 2, 3], dtype="<u4").tobytes()),  # one entry short
    columns(token_offsets=np.array([0, 3, 2, 2, 6], dtype="<u4").tobytes()),  # decreasing
    columns(token_ids=b"\x01\x02\x03"),  # not whole uint32 values
    columns(finish_reasons=bytes([0, 1, 9, 2])),  # unknown code
    columns(num_cached_tokens=np.array([-2, 0, 0, 0], dtype="<i8").tobytes()),
    columns(extras=[[7, None, None, None]]),  # row out of range
    columns(request_ids=["a", "b"]),  # fewer ids than rows
    columns()[:5],  # a column missing
])
def test_malformed_columns_are_a_protocol_error(bad: list[object]) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(msgpack.packb(["outputs", 0, bad, {}, []], use_bin_type=True))
