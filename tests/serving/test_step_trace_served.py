"""``--step-trace`` in an engine process: the engine loop records each step (cycle timing,
see fastsched.engine.step_trace) and the file is complete once the process has exited."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("msgpack", reason="msgpack is not installed (requirements-serve.txt)")
pytest.importorskip("zmq", reason="pyzmq is not installed (requirements-serve.txt)")

from fastsched.engine.engine_proc import stop_engine_processes
from fastsched.frontend.async_llm import AsyncLLM
from fastsched.frontend.settings import FrontendSettings
from fastsched.sampling_params import SamplingParams


def test_a_served_engine_writes_one_line_per_step(launch_engines: Callable, tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    engines = launch_engines(num_frontends=1, step_trace=str(path))

    async def body() -> None:
        llm = await AsyncLLM.start(
            engines.input_addrs, engines.output_addrs[0], settings=FrontendSettings(ready_timeout=60)
        )
        try:
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            async for _ in llm.generate("r", [5] * 10, params):
                pass
        finally:
            await llm.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))
    assert stop_engine_processes(engines.procs) == [0]
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(s["batched_tokens"], s["running_reqs"], s["prefill_tokens"]) for s in steps] == [
        (10, 1, 10),
        (1, 1, 0),
        (1, 1, 0),
    ]
    assert all(s["duration_s"] >= 0 for s in steps)
