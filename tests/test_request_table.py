"""The frontend's request table (``frontend.request_table``): the one place that holds a request's
state and the per-engine in-flight counts, and publishes ``first_token`` / ``child_finished`` /
``finished`` to its subscribers instead of calling each of them. No engines: outputs are handed in."""

from __future__ import annotations

import asyncio
import time

from fastsched.engine.protocol import EngineCoreOutput, EngineStats, Outputs
from fastsched.frontend.output_processor import OutputProcessor
from fastsched.frontend.request_table import RequestState, RequestTable
from fastsched.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fastsched.sampling_params import SamplingParams


class _Tokenizer:
    eos_token_ids = ()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(96 + i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(96 + i) for i in ids]


def _state(request_id: str, engine: int, n: int, stop: list[str] | None = None) -> RequestState:
    params = SamplingParams(n=n, max_tokens=8, stop=stop)
    child_ids = [f"e.{request_id}#{i}" for i in range(n)]
    parent = RequestOutput(request_id, None, [1, 2], [CompletionOutput(index=i) for i in range(n)])
    processor = OutputProcessor(_Tokenizer())  # type: ignore[arg-type]
    for i, child in enumerate(child_ids):
        processor.add_request(child, parent, i, SamplingParams(max_tokens=8, stop=stop))
    return RequestState(
        request_id,
        engine,
        n,
        parent,
        processor,
        child_ids,
        RequestMetrics(time.time(), num_prompt_tokens=2),
        prefilling=set(child_ids),
        max_tokens=8,
    )


def _outputs(engine: int, *outs: EngineCoreOutput) -> Outputs:
    return Outputs(engine, list(outs), EngineStats())


class _Recorder:
    def __init__(self, table: RequestTable) -> None:
        self.events: list[tuple] = []
        self.aborts: list[tuple[int, list[str]]] = []
        table.on_added.append(lambda s: self.events.append(("added", s.request_id)))
        table.on_first_token.append(lambda s: self.events.append(("first_token", s.request_id)))
        table.on_child_finished.append(lambda s, i, c, r: self.events.append(("child_finished", c, r)))
        table.on_finished.append(
            lambda s, e, counted: self.events.append(("finished", s.request_id, e, counted))
        )


def _table() -> tuple[RequestTable, _Recorder]:
    aborts: list[tuple[int, list[str]]] = []
    table = RequestTable(2, lambda engine, ids: aborts.append((engine, ids)))
    recorder = _Recorder(table)
    recorder.aborts = aborts
    return table, recorder


def test_in_flight_sequences_per_engine_are_counted_by_the_table_alone() -> None:
    async def go() -> None:
        table, rec = _table()
        a, b = _state("a", 0, 2), _state("b", 1, 1)
        table.add(a)
        table.add(b)
        assert table.in_flight == [2, 1] and "a" in table and len(table) == 2
        table.drop(a)  # its consumer went away: both children are aborted in engine 0
        assert rec.aborts == [(0, ["e.a#0", "e.a#1"])]
        assert table.in_flight == [0, 1] and "a" not in table and a.done
        table.drop(a)  # once only
        assert table.in_flight == [0, 1]

    asyncio.run(go())


def test_first_token_once_per_child_then_child_finished_and_finished_once() -> None:
    async def go() -> None:
        table, rec = _table()
        state = _state("r", 1, 2)
        table.add(state)
        table.apply_outputs(1, _outputs(1, EngineCoreOutput("e.r#0", [3]), EngineCoreOutput("e.r#0", [4])))
        table.apply_outputs(1, _outputs(1, EngineCoreOutput("e.r#1", [5], "length")))
        assert state.metrics.ttft is not None and state.prefilling == set()
        assert rec.events == [
            ("added", "r"),
            ("first_token", "r"),
            ("first_token", "r"),
            ("child_finished", "e.r#1", "length"),
        ]
        table.apply_outputs(1, _outputs(1, EngineCoreOutput("e.r#0", [6], "stop")))
        assert rec.events[-2:] == [("child_finished", "e.r#0", "stop"), ("finished", "r", None, True)]
        assert table.in_flight == [0, 0] and state.parent.finished and state.queue.qsize() == 3

    asyncio.run(go())


def test_an_early_end_reports_live_children_as_aborted_and_an_orphan_is_stopped() -> None:
    async def go() -> None:
        table, rec = _table()
        state = _state("x", 0, 2)
        table.add(state)
        table.apply_outputs(0, _outputs(0, EngineCoreOutput("e.x#0", [3], "length")))
        table.abort(state)
        assert rec.events[-2:] == [("child_finished", "e.x#1", "abort"), ("finished", "x", None, True)]
        assert rec.aborts == [(0, ["e.x#1"])]
        # A late output of an aborted child is dropped; a running one the table does not know is stopped.
        table.apply_outputs(0, _outputs(0, EngineCoreOutput("e.x#1", [4]), EngineCoreOutput("ghost", [1])))
        assert rec.aborts[-1] == (0, ["e.x#1", "ghost"])

    asyncio.run(go())


def test_a_failed_or_ignored_request_is_not_counted() -> None:
    async def go() -> None:
        table, rec = _table()
        failed, ignored = _state("f", 0, 1), _state("i", 1, 1)
        table.add(failed)
        table.add(ignored)
        table.fail(failed, RuntimeError("engine 0 died"))
        assert rec.events[-1] == ("finished", "f", "engine 0 died", False)
        table.apply_outputs(1, _outputs(1, EngineCoreOutput("e.i#0", [], "ignored", "too long")))
        assert rec.events[-1] == ("finished", "i", None, False)
        assert isinstance(ignored.queue.get_nowait(), ValueError)

    asyncio.run(go())
