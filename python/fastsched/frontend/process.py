"""A frontend process's main (spawned by ``fastsched serve``): one ``AsyncLLM`` and its
gRPC server, until SIGTERM or the launcher's death. It imports no torch: the model runs
in the engine processes only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from fastsched.admin import AdminSettings
from fastsched.frontend.settings import FrontendSettings

logger = logging.getLogger("fastsched.frontend")

PARENT_POLL_S = 0.5  # how often a frontend checks that the launcher is still there
FRONTEND_GRACE_S = 1.0  # the gRPC server's grace for calls in flight when a frontend stops


def block_sigint() -> None:
    """Ctrl-C signals the whole process group: only the launcher acts on it, so every
    child blocks SIGINT (and stops on SIGTERM)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


class _SiblingProcess:
    """``is_alive()`` for an engine process a frontend did not start (its sibling): a
    pidfd turns readable when the process exits, zombie or not, and never names a
    reused pid. Lets AsyncLLM notice a dead engine at once, not after engine_timeout."""

    exitcode = None  # only the parent can know it

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = -1  # already gone
        except (AttributeError, OSError):
            self._fd = None  # no pidfd (old kernel): fall back to /proc

    def is_alive(self) -> bool:
        if self._fd == -1:
            return False
        if self._fd is not None:
            readable, _, _ = select.select([self._fd], [], [], 0)
            return not readable
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")

    def close(self) -> None:
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class FrontendSpec:
    """Everything a frontend process needs from the launcher (picklable for spawn)."""

    index: int
    engine_input_addrs: tuple[str, ...]
    engine_pids: tuple[int, ...]
    output_addr: str
    grpc_host: str
    grpc_port: int
    shm_name: str
    settings: FrontendSettings  # the server's, validated before anything was spawned
    log_level: str
    api_key: str | None  # required on the gRPC port too (passed over the spawn pipe, never in argv)
    tokenizer_dir: str | None = None  # the launcher's export of the model's tokenizer (fast to load)
    admin: AdminSettings = field(default_factory=AdminSettings)  # the gRPC admin methods (fastsched.admin)


def run_frontend(spec: FrontendSpec, ready_pipe: Connection) -> None:
    """A frontend process's main: AsyncLLM + gRPC server until SIGTERM or the launcher's
    death. Sends a FrontendReady or a Failed message (``engine.protocol``) on ``ready_pipe``."""
    block_sigint()
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s [frontend {spec.index}] %(name)s: %(message)s",
    )
    sys.exit(asyncio.run(_frontend_main(spec, ready_pipe)))


async def _frontend_main(spec: FrontendSpec, ready_pipe: Connection) -> int:
    from fastsched._core import SharedAdmissionStats
    from fastsched.engine import protocol
    from fastsched.frontend.async_llm import AsyncLLM
    from fastsched.frontend.grpc_server import serve_frontend

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent_pid = os.getppid()

    async def watch_parent() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(PARENT_POLL_S)
        logger.warning("the launcher (pid %d) is gone; exiting", parent_pid)
        stop.set()

    watcher = asyncio.create_task(watch_parent())
    engines = [_SiblingProcess(pid) for pid in spec.engine_pids]
    llm = server = None
    address = f"{spec.grpc_host}:{spec.grpc_port}"
    try:
        try:
            shared = SharedAdmissionStats.open(spec.shm_name, spec.index)
            tokenizer = None
            if spec.tokenizer_dir is not None:
                from fastsched.model_loader import load_tokenizer

                tokenizer = await asyncio.to_thread(load_tokenizer, spec.tokenizer_dir)
            starting = asyncio.create_task(
                AsyncLLM.start(
                    spec.engine_input_addrs,
                    spec.output_addr,
                    frontend_index=spec.index,
                    settings=spec.settings,
                    shared_stats=shared,
                    engine_procs=engines,
                    tokenizer=tokenizer,
                )
            )
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not starting.done():  # stopped while waiting for the engines
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
                return 0
            llm = starting.result()
            server = await serve_frontend(
                llm,
                spec.grpc_host,
                spec.grpc_port,
                api_key=spec.api_key,
                limits=spec.settings.limits,
                admin=spec.admin,
            )
        except Exception as e:
            logger.error("frontend %d failed to start: %s", spec.index, e)
            with contextlib.suppress(OSError):
                message = f"frontend {spec.index} failed to start: {type(e).__name__}: {e}"
                ready_pipe.send_bytes(protocol.encode(protocol.Failed(spec.index, message)))
            return 1
        ready_pipe.send_bytes(protocol.encode(protocol.FrontendReady(spec.index, address)))
        ready_pipe.close()
        await stop.wait()
        logger.info("frontend %d stopping", spec.index)
        return 0
    finally:
        # Stopping already: a second SIGTERM (the launcher's, after a signal to the whole
        # process group) must not kill the clean-up half way.
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        watcher.cancel()
        if server is not None:
            await server.stop(FRONTEND_GRACE_S)
        if llm is not None:
            await llm.shutdown()
        for engine in engines:
            engine.close()
        logger.info("frontend %d stopped", spec.index)
