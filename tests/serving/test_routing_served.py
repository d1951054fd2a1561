"""Prefix-aware routing end to end (``frontend.routing``, issue 26 item 2): two engine
processes that send KV_EVENTS, and two frontends; what one frontend learns of an engine's
cache comes from that engine's events alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from engine_stack import Engines, ipc_dir, teardown

from fastsched.frontend.async_llm import AsyncLLM
from fastsched.frontend.routing import CAUSE_LOAD, CAUSE_PREFIX
from fastsched.frontend.settings import FrontendSettings
from fastsched.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fastsched.outputs import RequestOutput

SYSTEM = [(7 * i) % 200 + 5 for i in range(64)]  # a shared system prompt: four 16-token blocks
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def event_engines(engine_config: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    from fastsched.engine.engine_proc import start_engine_process

    directory = ipc_dir(tmp_path_factory, "ipc")
    inputs = [f"ipc://{directory}/engine{i}.in" for i in range(2)]
    outputs = [f"ipc://{directory}/frontend{i}.out" for i in range(2)]
    procs = [
        start_engine_process(
            {**engine_config, "block_size": 16},
            i,
            inputs[i],
            outputs,
            torch_num_threads=1,
            heartbeat_interval=0.5,
            kv_events=True,
        )
        for i in range(2)
    ]
    engines = Engines(inputs, outputs, procs)
    try:
        yield engines
    finally:
        teardown(engines, expect_clean_exit=True)


@asynccontextmanager
async def frontend(engines: Engines, index: int, **settings: Any) -> AsyncIterator[AsyncLLM]:
    llm = await AsyncLLM.start(
        engines.input_addrs,
        engines.output_addrs[index],
        frontend_index=index,
        settings=FrontendSettings(ready_timeout=60, num_frontends=2, **settings),
    )
    try:
        yield llm
    finally:
        await llm.shutdown()


async def complete(llm: AsyncLLM, request_id: str, tokens: list[int], max_tokens: int = 2) -> RequestOutput:
    out = None
    async with llm.generate(request_id, tokens, SamplingParams(max_tokens=max_tokens, **GREEDY)) as stream:
        async for snapshot in stream:
            out = snapshot
    assert out is not None and out.finished
    return out


async def until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_a_frontend_follows_the_engines_cache_events_to_the_engine_holding_the_prefix(
    event_engines: Engines,
) -> None:
    """Frontend 0 sends the system prompt to engine 1 (engine 0 is busy). Frontend 1 has
    routed nothing yet: by load it would pick engine 0, but engine 1's KV_EVENTS say that
    engine 1 holds the prefix, so it goes there, and is a prefix-cache hit. Once the engines
    drop their caches, the removal events send the next request by load again."""

    async def body() -> None:
        async with frontend(event_engines, 0) as fe0, frontend(event_engines, 1) as fe1:
            busy = fe0.generate("busy", [3] * 8, SamplingParams(max_tokens=200, **GREEDY))
            async with busy:
                first = await complete(fe0, "first", SYSTEM + [11, 12, 13])
            status = await fe0.request_status("first")
            assert status is not None and status["engine"] == 1 and status["routing"].startswith(CAUSE_LOAD)
            assert fe1.router is not None and fe1.router.policy == "prefix"
            await until(
                lambda: (
                    fe1.router.summary.prefix_blocks(
                        fe1.router.hasher.prompt_hashes(SYSTEM).tolist(), [0, 1]
                    )[1]
                    == 4
                ),
                "engine 1's KV events",
            )
            second = await complete(fe1, "second", SYSTEM + [21, 22, 23])
            status = await fe1.request_status("second")
            assert status is not None and status["engine"] == 1
            assert status["routing"].startswith(CAUSE_PREFIX)
            assert second.num_cached_tokens == len(SYSTEM) and first.num_cached_tokens == 0
            assert fe1.stats()["routing_decisions_total"][CAUSE_PREFIX] == 1

            await fe0.reset_prefix_cache()
            await until(
                lambda: (
                    fe1.router.summary.prefix_blocks(
                        fe1.router.hasher.prompt_hashes(SYSTEM).tolist(), [0, 1]
                    )[1]
                    == 0
                ),
                "the removal events",
            )
            third = await complete(fe1, "third", SYSTEM + [31])
            status = await fe1.request_status("third")
            assert status is not None and status["routing"].startswith(CAUSE_LOAD)
            assert third.num_cached_tokens == 0

    asyncio.run(asyncio.wait_for(body(), 120))


def test_load_routing_spreads_a_shared_prefix_over_the_engines(event_engines: Engines) -> None:
    """``--routing load``: two requests with one system prompt, the first still in flight,
    go to different engines."""

    async def body() -> None:
        async with frontend(event_engines, 0, routing="load") as fe0:
            async with fe0.generate("a", SYSTEM + [1], SamplingParams(max_tokens=50, **GREEDY)):
                await complete(fe0, "b", SYSTEM + [2])
                status = await fe0.request_status("b")
                assert (
                    status is not None and status["engine"] == 1 and status["routing"].startswith(CAUSE_LOAD)
                )

    asyncio.run(asyncio.wait_for(body(), 120))
