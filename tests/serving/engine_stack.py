"""Engine processes for the serving tests: started on ipc sockets, stopped and checked.

A module of its own (not conftest.py) so that test modules can import it by a name no
other test folder uses.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest


@dataclass
class Engines:
    """D engine processes, each pushing to the same F frontend output addresses."""

    input_addrs: list[str]
    output_addrs: list[str]
    procs: list[BaseProcess]


def ipc_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    path = tmp_path_factory.mktemp(name)
    # A unix socket path is limited to ~107 bytes.
    assert len(str(path)) < 80, f"ipc directory path too long for unix sockets: {path}"
    return path


def launch(engine_config: dict, directory: Path, num_engines: int, num_frontends: int) -> Engines:
    from fastsched.engine.engine_proc import (
        start_engine_process,
    )  # needs pyzmq: imported by the tests that use it

    inputs = [f"ipc://{directory}/engine{i}.in" for i in range(num_engines)]
    outputs = [f"ipc://{directory}/frontend{i}.out" for i in range(num_frontends)]
    procs = [
        start_engine_process(
            engine_config, i, inputs[i], outputs, torch_num_threads=1, heartbeat_interval=0.5
        )
        for i in range(num_engines)
    ]
    return Engines(inputs, outputs, procs)


def teardown(engines: Engines, expect_clean_exit: bool = False) -> None:
    from fastsched.engine.engine_proc import stop_engine_processes

    codes = stop_engine_processes(engines.procs, timeout=10.0)
    if expect_clean_exit:
        assert codes == [0] * len(codes), f"engine processes exited with {codes} on SIGTERM"
    for proc in engines.procs:
        assert not proc.is_alive(), f"engine process {proc.pid} outlived its test"
    alive = [p for p in multiprocessing.active_children() if p in engines.procs]
    assert not alive, f"orphan engine processes: {alive}"
