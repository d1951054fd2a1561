"""A frontend's connection to its D engine processes (docs/design.md §1, §6): the ZMQ
sockets, the READY handshake, the health monitor and the reviver, and the command RPCs
(pause, reload, status queries).

It knows engines and request *ids*, never a request's state: one output-reader task
decodes every engine's messages and hands each ``Outputs`` to the ``on_outputs``
callback (the request table's job); a monitor task marks an engine dead when it goes
silent or its process exits, and tells ``on_engine_dead`` so that no request ever waits on
a dead engine. A dead engine stays dead until a new process at its address says READY
(the launcher restarts engines under ``--enable-fault-tolerance``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio

from fastsched.engine import protocol
from fastsched.engine.protocol import EngineRequestStatus, EngineStats, ModelInfo
from fastsched.frontend.request_metrics import EngineRequestMetrics

__all__ = ["EngineClient", "EngineConnection", "EngineDeadError", "HELLO_INTERVAL"]

logger = logging.getLogger("fastsched.frontend")

HELLO_INTERVAL = 1.0  # seconds between HELLOs to an engine that has not answered READY


class EngineDeadError(RuntimeError):
    """The engine serving a request died (or this AsyncLLM shut down): the request
    cannot finish. Without fault tolerance also what new requests get (fail fast)."""


class ProcessHandle(Protocol):
    def is_alive(self) -> bool: ...


@dataclass
class EngineConnection:
    """One engine as this frontend sees it: its socket, health and latest reports."""

    index: int
    push: zmq.Socket
    process: ProcessHandle | None
    info: ModelInfo | None = None
    stats: EngineStats = field(default_factory=EngineStats)
    healthy: bool = True
    dead_reason: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    process_stats: dict[str, float] | None = None  # its process's resource use, from the latest heartbeat
    requests: EngineRequestMetrics | None = None  # this frontend's requests to it, once it is ready


def _same_model(a: ModelInfo, b: ModelInfo) -> bool:
    return (a.model, a.max_model_len, a.vocab_size) == (b.model, b.max_model_len, b.vocab_size)


class EngineClient:
    """Sockets to every engine's input and this frontend's output PULL; used from one event loop.

    ``on_outputs(engine_index, msg)`` receives every ``Outputs``; ``on_engine_dead(index, reason)``
    is called once when an engine is marked dead; ``on_stats()`` whenever an engine's stats or
    health change (the TTFT-SLO valve's throughput); ``on_kv_events(msg)`` every KV_EVENTS
    (``--routing prefix``)."""

    def __init__(
        self,
        engine_input_addrs: Sequence[str],
        output_addr: str,
        *,
        frontend_index: int,
        engine_procs: Sequence[ProcessHandle | None] | None,
        engine_timeout: float,
    ) -> None:
        if not engine_input_addrs:
            raise ValueError("at least one engine input address is needed")
        if engine_procs is not None and len(engine_procs) != len(engine_input_addrs):
            raise ValueError(
                f"got {len(engine_procs)} engine process handles for {len(engine_input_addrs)} engines"
            )
        self.frontend_index = frontend_index
        self.output_addr = output_addr
        self.engine_timeout = engine_timeout
        self.on_outputs: Callable[[int, protocol.Outputs], None] = lambda index, msg: None
        self.on_engine_dead: Callable[[int, str], None] = lambda index, reason: None
        self.on_stats: Callable[[], None] = lambda: None
        self.on_kv_events: Callable[[protocol.KvEvents], None] = lambda msg: None
        self._ctx = zmq.asyncio.Context()
        self._send_ctx = zmq.Context()  # plain sockets: a send never awaits (abort from __del__ / finally)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        try:
            self._pull.bind(output_addr)
        except zmq.ZMQError as e:
            self._pull.close()
            self._ctx.term()
            self._send_ctx.term()
            raise OSError(
                f"frontend {frontend_index} cannot bind its output address {output_addr}: {e}"
            ) from e
        self.engines: list[EngineConnection] = []
        for i, addr in enumerate(engine_input_addrs):
            push = self._send_ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(addr)
            self.engines.append(EngineConnection(i, push, None if engine_procs is None else engine_procs[i]))
        # Query id -> the engine's answer: STATUS for a QUERY, PAUSED / RELOADED for a command.
        self._queries: dict[int, asyncio.Future[list[EngineRequestStatus]]] = {}
        self._commands: dict[int, asyncio.Future[protocol.Message]] = {}
        # A random start: an answer queued for a predecessor on this address must not answer ours.
        self._query_ids = itertools.count(secrets.randbelow(2**62))
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = False

    # ------------------------------------------------------------ lifecycle

    async def connect(self, ready_timeout: float) -> ModelInfo:
        """Start reading, HELLO every engine until each has answered READY, and start the
        monitor. Returns engine 0's model. ``TimeoutError`` after ``ready_timeout`` s;
        ``RuntimeError`` at once if an engine reports failure or its process exits, or
        when two engines serve different models."""
        self._tasks.append(asyncio.create_task(self._read_outputs(), name="fastsched-output-reader"))
        deadline = time.monotonic() + ready_timeout
        hello = protocol.encode(protocol.Hello(self.frontend_index))
        while not all(e.info is not None for e in self.engines):
            for e in self.engines:
                if not e.healthy:
                    raise RuntimeError(f"engine {e.index} failed before it was ready: {e.dead_reason}")
                if e.process is not None and not e.process.is_alive():
                    code = getattr(e.process, "exitcode", None)
                    raise RuntimeError(
                        f"engine {e.index} exited (exit code {code}) before it was ready; see its log"
                    )
                if e.info is None:
                    self._send_bytes(e, hello)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [e.index for e in self.engines if e.info is None]
                raise TimeoutError(f"engine(s) {missing} did not report ready within {ready_timeout:g} s")
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), min(HELLO_INTERVAL, remaining))
            except TimeoutError:
                pass
        first = self.engines[0].info
        assert first is not None
        for e in self.engines[1:]:
            assert e.info is not None
            if not _same_model(e.info, first):
                raise RuntimeError(f"engine {e.index} serves {e.info} but engine 0 serves {first}")
        now = time.monotonic()
        for e in self.engines:
            e.last_seen = now
        self._tasks.append(asyncio.create_task(self._monitor(), name="fastsched-engine-monitor"))
        return first

    async def close(self) -> None:
        """Stop the tasks and close the sockets (aborts already sent get 0.5 s to reach live engines)."""
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pull.close(linger=0)
        for e in self.engines:
            e.push.close(linger=500 if e.healthy else 0)
        self._ctx.term()
        self._send_ctx.term()

    # ------------------------------------------------------------ health

    def healthy(self) -> list[EngineConnection]:
        return [e for e in self.engines if e.healthy]

    def all_healthy(self) -> bool:
        return all(e.healthy for e in self.engines)

    def dead_reasons(self) -> str:
        return "; ".join(f"engine {e.index}: {e.dead_reason}" for e in self.engines)

    async def _monitor(self) -> None:
        interval = min(0.25, self.engine_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for e in self.engines:
                if not e.healthy:
                    continue
                if e.process is not None and not e.process.is_alive():
                    code = getattr(e.process, "exitcode", None)
                    self._mark_dead(e, f"its process exited (exit code {code})")
                elif now - e.last_seen > self.engine_timeout:
                    silence = now - e.last_seen
                    self._mark_dead(
                        e, f"no message for {silence:.1f} s (engine_timeout {self.engine_timeout:g} s)"
                    )

    def _mark_dead(self, engine: EngineConnection, reason: str) -> None:
        if not engine.healthy:
            return
        engine.healthy = False
        engine.dead_reason = reason
        logger.error("frontend %d: engine %d is dead: %s", self.frontend_index, engine.index, reason)
        self.on_stats()
        self.on_engine_dead(engine.index, reason)

    def _revive(self, engine: EngineConnection, info: ModelInfo) -> None:
        """A restarted engine said READY: serve with it again, from fresh stats. Its
        process handle named the old process, so from now on only silence
        (``engine_timeout``) marks it dead here; the launcher watches the process."""
        first = next((e.info for e in self.engines if e is not engine and e.info is not None), engine.info)
        if first is not None and not _same_model(info, first):
            logger.error(
                "frontend %d: restarted engine %d serves %s, not %s; left dead",
                self.frontend_index,
                engine.index,
                info,
                first,
            )
            return
        engine.healthy, engine.dead_reason, engine.info = True, None, info
        engine.stats, engine.last_seen, engine.process = EngineStats(), time.monotonic(), None
        logger.info("frontend %d: engine %d is back (restarted)", self.frontend_index, engine.index)
        self.on_stats()

    # ------------------------------------------------------------ sending

    def send(self, engine_index: int, msg: protocol.Message) -> None:
        """``EngineDeadError`` when the socket refuses it."""
        self._send_bytes(self.engines[engine_index], protocol.encode(msg))

    def abort(self, engine_index: int, request_ids: list[str]) -> None:
        """Abort engine requests on a live engine (nothing to do on a dead one or after close)."""
        engine = self.engines[engine_index]
        if request_ids and engine.healthy and not self.closed:
            self._send_bytes(engine, protocol.encode(protocol.Abort(request_ids)))

    def _send_bytes(self, engine: EngineConnection, data: bytes) -> None:
        try:
            engine.push.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot send to engine {engine.index}: {e}") from e

    async def query(self, engine_index: int, request_ids: list[str]) -> list[EngineRequestStatus]:
        """The engine's status of ``request_ids`` (a QUERY answered by STATUS); ``TimeoutError``
        when it does not answer within ``engine_timeout``."""
        query_id = next(self._query_ids)
        self._queries[query_id] = answer = asyncio.get_running_loop().create_future()
        try:
            self.send(engine_index, protocol.Query(query_id, request_ids, self.frontend_index))
            return await asyncio.wait_for(answer, self.engine_timeout)
        finally:
            self._queries.pop(query_id, None)

    async def command_all(
        self, make: Callable[[int], protocol.Message], timeout: float
    ) -> dict[int, protocol.Message]:
        """Sends ``make(query_id)`` to every live engine; their answers, by engine index.
        ``TimeoutError`` naming an engine that does not answer within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        waits = []
        for e in self.healthy():
            query_id = next(self._query_ids)
            self._commands[query_id] = answer = loop.create_future()
            waits.append((query_id, e, answer))
            self._send_bytes(e, protocol.encode(make(query_id)))
        answers = {}
        try:
            for query_id, e, answer in waits:
                try:
                    answers[e.index] = await asyncio.wait_for(answer, timeout)
                except TimeoutError:
                    raise TimeoutError(f"engine {e.index} did not answer within {timeout:g} s") from None
        finally:
            for query_id, _, _ in waits:
                self._commands.pop(query_id, None)
        return answers

    # ------------------------------------------------------------ receiving

    async def _read_outputs(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                msg = protocol.decode(data)
            except protocol.ProtocolError as e:
                logger.warning("frontend %d: dropped a malformed engine message: %s", self.frontend_index, e)
                continue
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not stop every stream
                logger.exception("frontend %d: failed to handle %s", self.frontend_index, type(msg).__name__)

    def _dispatch(self, msg: protocol.Message) -> None:
        index = getattr(msg, "engine_index", None)
        if index is None or index >= len(self.engines):
            logger.warning("frontend %d: unexpected %s message", self.frontend_index, type(msg).__name__)
            return
        engine = self.engines[index]
        if not engine.healthy:
            if isinstance(msg, protocol.Ready):  # a new process at its address (the launcher restarted it)
                self._revive(engine, msg.model_info)
            return  # a dead engine's own messages are ignored: its requests have already failed
        engine.last_seen = time.monotonic()
        if isinstance(msg, protocol.Outputs):
            engine.stats = msg.stats
            self.on_stats()
            self.on_outputs(index, msg)
        elif isinstance(msg, protocol.KvEvents):
            self.on_kv_events(msg)
        elif isinstance(msg, protocol.Heartbeat):
            engine.stats = msg.stats
            if msg.stats.process is not None:
                engine.process_stats = msg.stats.process
            self.on_stats()
        elif isinstance(msg, protocol.Ready):
            if engine.info is None:
                logger.debug(
                    "frontend %d: engine %d ready (model=%s KV blocks=%d)",
                    self.frontend_index,
                    index,
                    msg.model_info.model_name,
                    msg.model_info.num_gpu_blocks,
                )
            engine.info = msg.model_info
            if engine.requests is None:
                engine.requests = EngineRequestMetrics(msg.model_info.max_model_len)
            self.on_stats()
            self._ready.set()
        elif isinstance(msg, protocol.Failed):
            self._mark_dead(engine, msg.message)
            self._ready.set()
        elif isinstance(msg, protocol.Status):
            answer = self._queries.get(msg.query_id)
            if answer is not None and not answer.done():
                answer.set_result(msg.statuses)
        elif isinstance(msg, (protocol.Paused, protocol.Reloaded, protocol.PrefixCacheReset)):
            if isinstance(msg, protocol.Paused):
                engine.stats.pause_state = msg.state
            reply = self._commands.get(msg.query_id)
            if reply is not None and not reply.done():
                reply.set_result(msg)
