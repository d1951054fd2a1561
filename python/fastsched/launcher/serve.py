"""``fastsched serve``: the whole server of docs/design.md §1 from one command.

The launcher (this process) starts, in order:

1. D EngineCore processes (spawned; ``engine_proc.run_engine``), engine ``i`` bound at
   ``ipc://<dir>/engine<i>.in`` and pushing to every frontend;
2. K gRPC frontend processes (spawned; ``frontend.process.run_frontend``), frontend ``k`` bound at
   ``ipc://<dir>/frontend<k>.out`` and serving gRPC on ``grpc_port + k``, each with its
   own event loop, one ``AsyncLLM`` and its slot ``k`` of the shared admission counters
   (A6);
3. the gateway (uvicorn, in this process's event loop) over the K frontends.

``<dir>`` is a private temporary directory (0700). The shared-memory segment of the A6
counters is created here before any frontend starts, named
``fastsched-serve-<pid>-<random>``. Both are removed at exit; a later launcher also
removes those left by a launcher that was killed (its pid is in the name).

Shutdown (SIGINT or SIGTERM to the launcher) goes gateway → frontends → engines: the
gateway stops accepting and lets requests in flight finish for up to
``shutdown_timeout`` seconds (``--shutdown-timeout``; the engines still run meanwhile),
then each kind of child gets SIGTERM, and SIGKILL if it is still there
``STOP_TIMEOUT_S`` later. A second signal skips the waiting. Children block SIGINT so
that Ctrl-C in a terminal (which signals the whole process group) reaches only the
launcher and this order holds; they stop on SIGTERM, and on their own when the launcher
disappears (each polls its parent).

Supervision. A child that fails while starting makes the launcher stop the others and
exit 1 with the child's error (:class:`ServeError`). Once serving, the launcher watches
every child for exit (its process sentinel) *and* for liveness: every
``SUPERVISE_INTERVAL_S`` it asks each frontend for its stats over gRPC. A frontend that
has not answered for ``engine_timeout`` seconds is hung; an engine a frontend reports
``dead`` (exited, or silent for ``engine_timeout``: engines send the frontends a
heartbeat each second) is dead or hung.

- Without ``enable_fault_tolerance``, a dead or hung child ends the server: the hung one
  is killed, the rest are shut down in order, and the launcher exits 1 — so a process
  supervisor (systemd, Kubernetes) restarts it, as vLLM does.
- With it, a dead or hung *engine* is killed and started again (after a back-off of 1,
  2, 4 ... s), at most ``max_engine_restarts`` times over the server's life; its
  requests in flight have already ended with a retryable 503 ``engine_faulted``; the
  frontends serve with it again once it reports READY (``/health`` is 200 again), and
  its gauges are left out of ``/metrics`` meanwhile. A dead or hung frontend, or the
  gateway, always ends the launcher.

Log lines meant to be read by people and by scripts (the process tests rely on them)::

    ipc dir /tmp/fastsched-serve-123-abcd; shared admission stats /dev/shm/fastsched-serve-123-9f3e
    engine 0 ready (pid 4567): model=... max_model_len=... KV blocks=...
    frontend 1 serving gRPC on 127.0.0.1:50052 (pid 4570)
    gateway listening on http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import glob
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from fastsched.frontend.process import FrontendSpec, block_sigint, run_frontend
from fastsched.launcher.serve_config import ServeConfig, ServeError

logger = logging.getLogger("fastsched.serve")

NAME_PREFIX = "fastsched-serve-"  # of the ipc directory and the shared-memory segment
STOP_TIMEOUT_S = 5.0  # per kind of child, between SIGTERM and SIGKILL
SUPERVISE_INTERVAL_S = 1.0  # how often the launcher asks the frontends how they and the engines are
RESTART_BACKOFF_S = 1.0  # before an engine's first restart; doubled for each further one
MAX_RESTART_BACKOFF_S = 30.0


# ------------------------------------------------------------------ children


@dataclass
class _Child:
    kind: str  # "engine" | "frontend"
    index: int
    proc: BaseProcess
    ready_pipe: Connection | None  # the launcher's end; None once it has answered
    ready: bool = False
    info: Any = None  # an engine's protocol.ModelInfo
    restarts: int = 0  # times this engine was started again (fault tolerance)
    restarting: bool = False
    ready_at: float = 0.0  # monotonic time of its last READY

    @property
    def name(self) -> str:
        return f"{self.kind} {self.index}"


def _engine_main(*args: Any, **kwargs: Any) -> None:
    block_sigint()  # before torch's import starts threads: they inherit the mask
    # Several processes share the terminal: a progress bar's \r fragments would cut through
    # the others' log lines, so engines log a line per loading phase instead.
    os.environ["TQDM_DISABLE"] = "1"
    from fastsched.engine.engine_proc import run_engine

    run_engine(*args, **kwargs)


def _spawn(target: Any, name: str, args: tuple, kwargs: dict[str, Any]) -> BaseProcess:
    # Spawned, not forked: torch, gRPC and ZMQ state must not be copied (as engine_proc does).
    proc = multiprocessing.get_context("spawn").Process(
        target=target, args=args, kwargs=kwargs, name=name, daemon=True
    )
    proc.start()
    return proc


def _ready_pipe() -> tuple[Connection, Connection]:
    """(the launcher's end, the child's end) of a one-way pipe for the child's READY/FAILED."""
    launcher_end, child_end = multiprocessing.get_context("spawn").Pipe(duplex=False)
    return launcher_end, child_end


# ------------------------------------------------------------------ the launcher


class _Signals:
    """SIGINT/SIGTERM to the launcher: the first asks for a clean shutdown, the next
    ones for a fast one. Handlers only record (logging from a handler can deadlock)."""

    def __init__(self) -> None:
        self.count = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def install(self) -> dict[int, Any]:
        return {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self._loop is not None and self._event is not None:
            self._loop.call_soon_threadsafe(self._event.set)

    def attach(self, loop: asyncio.AbstractEventLoop | None, event: asyncio.Event | None) -> None:
        self._loop, self._event = loop, event

    @property
    def stop(self) -> bool:
        return self.count > 0

    @property
    def force(self) -> bool:
        return self.count > 1


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(shm_dir: str = "/dev/shm", tmp_dir: str | None = None) -> list[str]:
    """Removes the ipc directories and shared-memory segments of launchers that died
    without cleaning up (A6: stale segments are cleaned up); returns what it removed."""
    removed = []
    tmp_dir = tmp_dir or tempfile.gettempdir()
    candidates = glob.glob(os.path.join(shm_dir, NAME_PREFIX + "*")) + glob.glob(
        os.path.join(tmp_dir, NAME_PREFIX + "*")
    )
    for path in candidates:
        try:
            pid = int(os.path.basename(path)[len(NAME_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        with contextlib.suppress(OSError):
            if pid == os.getpid() or _pid_alive(pid) or os.stat(path).st_uid != os.getuid():
                continue
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
    return removed


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"the gateway cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _free_port(host: str) -> int:
    """A port the kernel reports free now (``--grpc-port 0``); the frontend binds it moments later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _check_port_free(host: str, port: int) -> None:
    """Best effort, so that a taken gRPC port fails before any process starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ServeError(
                    f"a gRPC frontend cannot listen on {host}:{port}: the port is in use "
                    "(choose another --grpc-port, or 0 for free ports)"
                ) from e
            raise ServeError(f"a gRPC frontend cannot listen on {host}:{port}: {e}") from e


class Launcher:
    """One run of ``fastsched serve``: :meth:`run` returns the exit code."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.signals = _Signals()
        self.engines: list[_Child] = []
        self.frontends: list[_Child] = []
        self.ipc_dir: str | None = None
        self.shm: Any = None
        self.http_sock: socket.socket | None = None
        self.grpc_ports = config.grpc_ports
        self.tokenizer_dir: str | None = None
        self.started_at = time.monotonic()
        self.exit_code = 0
        self.engine_inputs: list[str] = []
        self.frontend_outputs: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()  # engine restarts in progress

    # ------------------------------------------------------------ start-up

    def run(self) -> int:
        previous = self.signals.install()
        try:
            self._start()
            if not self.signals.stop:
                asyncio.run(self._serve_gateway())
        finally:
            self.signals.attach(None, None)
            self._shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.exit_code

    def _start(self) -> None:
        from fastsched._core import SharedAdmissionStats

        c = self.config
        for path in remove_stale():
            logger.info("removed %s, left by a launcher that is gone", path)
        self.http_sock = _listen(c.host, c.port)
        if c.grpc_port == 0:
            self.grpc_ports = [_free_port(c.grpc_host) for _ in range(c.api_server_count)]
            logger.info("--grpc-port 0: frontends will listen on ports %s", self.grpc_ports)
        for port in self.grpc_ports:
            _check_port_free(c.grpc_host, port)
        self.ipc_dir = tempfile.mkdtemp(prefix=f"{NAME_PREFIX}{os.getpid()}-")  # mode 0700
        self.shm = SharedAdmissionStats.create(
            f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(4)}", c.api_server_count
        )
        logger.info("ipc dir %s; shared admission stats %s", self.ipc_dir, self.shm.path)
        engine_inputs = [f"ipc://{self.ipc_dir}/engine{i}.in" for i in range(c.data_parallel_size)]
        frontend_outputs = [f"ipc://{self.ipc_dir}/frontend{k}.out" for k in range(c.api_server_count)]
        self.engine_inputs, self.frontend_outputs = engine_inputs, frontend_outputs
        for i in range(c.data_parallel_size):
            self.engines.append(self._start_engine(i))
        self.tokenizer_dir = self._export_tokenizer()
        engine_pids = [e.proc.pid for e in self.engines]
        for k, (addr, port) in enumerate(zip(frontend_outputs, self.grpc_ports)):
            ours_ready, theirs_ready = _ready_pipe()
            spec = FrontendSpec(
                k,
                tuple(engine_inputs),
                tuple(engine_pids),
                addr,
                c.grpc_host,
                port,
                self.shm.name,
                c.frontend,
                c.log_level,
                c.api_key,
                self.tokenizer_dir,
                c.admin,
            )
            proc = _spawn(run_frontend, f"fastsched-frontend-{k}", (spec, theirs_ready), {})
            theirs_ready.close()
            self.frontends.append(_Child("frontend", k, proc, ours_ready))
            logger.info("frontend %d starting (pid %d)", k, proc.pid)
        self._wait_ready(self.engines + self.frontends, time.monotonic() + c.frontend.ready_timeout + 10)

    def _start_engine(self, i: int) -> _Child:
        c = self.config
        ours_ready, theirs_ready = _ready_pipe()
        engine_kwargs = {
            "ready_pipe": theirs_ready,
            "log_level": c.log_level,
            "torch_num_threads": c.torch_num_threads,
            "kv_events": c.data_parallel_size > 1 and c.frontend.routing == "prefix",
        }
        proc = _spawn(
            _engine_main,
            f"fastsched-engine-{i}",
            (dict(c.engine_config), i, self.engine_inputs[i], self.frontend_outputs),
            engine_kwargs,
        )
        theirs_ready.close()
        logger.info("engine %d starting (pid %d)", i, proc.pid)
        return _Child("engine", i, proc, ours_ready)

    def _export_tokenizer(self) -> str:
        """The model's tokenizer as a small HF directory in the ipc dir, written while the
        engines load: frontends and the gateway read it in milliseconds instead of each
        parsing the model file again."""
        from fastsched.model_loader.export import export_tokenizer

        assert self.ipc_dir is not None
        engine = self.config.engine_config
        source = engine.get("tokenizer") or engine.get("model")
        start = time.monotonic()
        try:
            out = export_tokenizer(source, Path(self.ipc_dir) / "tokenizer")
        except Exception as e:
            raise ServeError(f"cannot read the tokenizer of {source or 'the default model'}: {e}") from e
        logger.info(
            "tokenizer of %s ready for the frontends in %.1f s",
            source or "the default model",
            time.monotonic() - start,
        )
        return str(out)

    def _wait_ready(self, children: list[_Child], deadline: float) -> None:
        from fastsched.engine import protocol

        while not self.signals.stop:
            waiting = [ch for ch in children if not ch.ready]
            if not waiting:
                return
            if time.monotonic() > deadline:
                names = ", ".join(ch.name for ch in waiting)
                raise ServeError(
                    f"{names} did not report ready within {self.config.frontend.ready_timeout:g} s"
                )
            handles: list[Any] = [ch.ready_pipe for ch in waiting] + [ch.proc.sentinel for ch in waiting]
            wait_connections(handles, timeout=0.2)
            for ch in waiting:
                pipe = ch.ready_pipe
                assert pipe is not None
                if pipe.poll():  # before the sentinel: a failing child reports, then exits
                    try:
                        msg = protocol.decode(pipe.recv_bytes())  # the engine wire, from every child
                    except EOFError:
                        msg = None
                    except protocol.ProtocolError as e:
                        raise ServeError(f"{ch.name} sent a malformed ready message: {e}") from None
                    if isinstance(msg, protocol.Failed):
                        raise ServeError(msg.message)
                    if isinstance(msg, protocol.Ready) and ch.kind == "engine":
                        ch.info = msg.model_info
                        logger.debug(  # the engine logs its own ready line
                            "engine %d ready (pid %d): model=%s max_model_len=%d KV blocks=%d",
                            ch.index,
                            ch.proc.pid,
                            ch.info.model_name,
                            ch.info.max_model_len,
                            ch.info.num_gpu_blocks,
                        )
                        self._mark_ready(ch)
                        continue
                    if isinstance(msg, protocol.FrontendReady) and ch.kind == "frontend":
                        logger.info(
                            "frontend %d serving gRPC on %s (pid %d)", ch.index, msg.address, ch.proc.pid
                        )
                        self._mark_ready(ch)
                        continue
                    if msg is not None:
                        raise ServeError(f"{ch.name} sent {type(msg).__name__} instead of its ready message")
                if not ch.proc.is_alive():
                    raise ServeError(
                        f"{ch.name} exited with code {ch.proc.exitcode} before it was ready; "
                        "see its log above"
                    )

    @staticmethod
    def _mark_ready(ch: _Child) -> None:
        ch.ready = True
        ch.ready_at = time.monotonic()
        if ch.ready_pipe is not None:
            ch.ready_pipe.close()
            ch.ready_pipe = None

    # ------------------------------------------------------------ serving

    async def _serve_gateway(self) -> None:
        from fastsched.gateway.access_log import quiet_probes
        from fastsched.gateway.app import create_app, gateway_server
        from fastsched.gateway.sessions import SessionSettings
        from fastsched.model_loader import load_tokenizer

        c = self.config
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        self.signals.attach(loop, stop)
        if self.signals.stop:
            return
        info = self.engines[0].info
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, self.tokenizer_dir)
        except Exception as e:
            model = info.model or "the default model"
            raise ServeError(f"the gateway cannot load the tokenizer of {model}: {e}") from e
        if c.chat_template is not None:
            tokenizer.chat_template = c.chat_template
        addrs = [f"{c.grpc_host}:{port}" for port in self.grpc_ports]
        sessions = SessionSettings(c.frontend.session_open_timeout, c.allowed_origins)
        app = create_app(
            addrs,
            c.served_model_name or [info.model_name],
            tokenizer,
            api_key=c.api_key,
            limits=c.frontend.limits,
            tool_parser=c.tool_call_parser,
            admin=c.admin,
            sessions=sessions,
            enable_prompt_tokens_details=c.enable_prompt_tokens_details,
            responses_store_size=c.responses_store_size,
        )
        server = gateway_server(
            app,
            c.host,
            c.port,
            log_config=None,
            log_level=c.uvicorn_log_level or c.log_level.lower(),
            access_log=c.access_log,
            timeout_graceful_shutdown=c.shutdown_timeout,
        )
        quiet_probes()
        # The launcher owns SIGINT/SIGTERM (shutdown order, second signal): uvicorn must not take them.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        dead: list[_Child] = []
        for ch in self.engines + self.frontends:
            loop.add_reader(ch.proc.sentinel, self._on_child_exit, loop, ch, dead, stop)
        assert self.http_sock is not None
        serving = asyncio.create_task(server.serve(sockets=[self.http_sock]))
        supervising = asyncio.create_task(self._supervise(app.state.gateway.pool, loop, dead, stop))
        try:
            while not server.started and not serving.done() and not stop.is_set():
                await asyncio.sleep(0.02)
            if server.started:
                logger.info(
                    "gateway listening on http://%s:%d (server ready %.1f s after start)",
                    _url_host(c.host),
                    self.http_sock.getsockname()[1],
                    time.monotonic() - self.started_at,
                )
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if serving.done():
                error = serving.exception() if not serving.cancelled() else None
                raise ServeError(f"the gateway stopped unexpectedly: {error!r}")
            if self.signals.stop:
                logger.info("shutting down (signal): gateway, then frontends, then engines")
            elif dead:
                self.exit_code = 1
                logger.error("shutting down: %s", ", ".join(f"{ch.name} died" for ch in dead))
        finally:
            supervising.cancel()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(supervising, *self._tasks, return_exceptions=True)
            for ch in self.engines + self.frontends:
                loop.remove_reader(ch.proc.sentinel)
            await self._stop_gateway(server, serving)
            logger.info("gateway stopped")

    async def _stop_gateway(self, server: Any, serving: asyncio.Task[None]) -> None:
        """Let requests in flight finish (uvicorn's graceful shutdown, ``shutdown_timeout``),
        cut them off at once on a second signal, give up on uvicorn a little later."""
        server.should_exit = True
        deadline = time.monotonic() + self.config.shutdown_timeout + 2
        while not serving.done():
            if self.signals.force or time.monotonic() > deadline:
                server.force_exit = True
            if time.monotonic() > deadline + 3:
                serving.cancel()
            await asyncio.wait({serving}, timeout=0.1)
        if not serving.cancelled() and serving.exception() is not None:
            logger.debug("the gateway ended with %r", serving.exception())

    def _on_child_exit(
        self, loop: asyncio.AbstractEventLoop, ch: _Child, dead: list[_Child], stop: asyncio.Event
    ) -> None:
        loop.remove_reader(ch.proc.sentinel)
        ch.proc.join(0)
        logger.error("%s (pid %d) exited unexpectedly with code %s", ch.name, ch.proc.pid, ch.proc.exitcode)
        self._on_child_failed(ch, "its process exited", loop, dead, stop)

    def _on_child_failed(
        self,
        ch: _Child,
        reason: str,
        loop: asyncio.AbstractEventLoop,
        dead: list[_Child],
        stop: asyncio.Event,
    ) -> None:
        """A child died or hangs: restart it (an engine, with fault tolerance) or end the server."""
        if ch.kind == "engine" and self.config.frontend.fault_tolerance:
            if not ch.restarting:
                ch.restarting = True
                task = asyncio.create_task(self._restart_engine(ch, reason, loop, dead, stop))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return
        if ch.proc.is_alive():  # hung: a stopped process would never act on SIGTERM
            logger.error("%s (pid %d) is hung (%s); killing it", ch.name, ch.proc.pid, reason)
            ch.proc.kill()
        if ch not in dead:
            dead.append(ch)
        stop.set()

    async def _supervise(
        self, pool: Any, loop: asyncio.AbstractEventLoop, dead: list[_Child], stop: asyncio.Event
    ) -> None:
        """The liveness half of supervision (the module docstring): frontends that stop
        answering, engines the frontends report dead."""
        timeout = self.config.frontend.engine_timeout
        last_answer = [time.monotonic()] * len(self.frontends)
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            replies = await pool.stats_by_frontend()
            now = time.monotonic()
            for ch, reply in zip(self.frontends, replies):
                if not isinstance(reply, BaseException):
                    last_answer[ch.index] = now
                    for engine in reply.engines:
                        self._on_engine_report(engine, now, loop, dead, stop)
                elif now - last_answer[ch.index] > timeout and ch.proc.is_alive():
                    self._on_child_failed(
                        ch, f"no answer to GetStats for {now - last_answer[ch.index]:.1f} s", loop, dead, stop
                    )

    def _on_engine_report(
        self,
        report: Any,
        now: float,
        loop: asyncio.AbstractEventLoop,
        dead: list[_Child],
        stop: asyncio.Event,
    ) -> None:
        if not report.dead or not 0 <= report.engine_index < len(self.engines):
            return
        ch = self.engines[report.engine_index]
        # Just restarted: frontends may not have read its READY yet when they answered.
        if ch.restarting or now - ch.ready_at < self.config.frontend.engine_timeout:
            return
        logger.error(
            "%s (pid %d) is reported dead by a frontend: %s", ch.name, ch.proc.pid, report.dead_reason
        )
        loop.remove_reader(ch.proc.sentinel)
        self._on_child_failed(ch, report.dead_reason, loop, dead, stop)

    async def _restart_engine(
        self,
        old: _Child,
        reason: str,
        loop: asyncio.AbstractEventLoop,
        dead: list[_Child],
        stop: asyncio.Event,
    ) -> None:
        """Kill ``old`` if it still runs, start its successor at the same addresses after a
        back-off, and wait for its READY (the frontends get theirs from it directly)."""
        c = self.config
        while True:
            if old.restarts >= c.max_engine_restarts:
                logger.error(
                    "%s failed (%s) after %d restarts (--max-engine-restarts); shutting down",
                    old.name,
                    reason,
                    old.restarts,
                )
                old.restarting = False
                self._on_child_failed_final(old, dead, stop)
                return
            if old.proc.is_alive():
                logger.error("%s (pid %d) is hung (%s); killing it", old.name, old.proc.pid, reason)
                old.proc.kill()
            await asyncio.to_thread(old.proc.join, STOP_TIMEOUT_S)
            delay = min(RESTART_BACKOFF_S * 2**old.restarts, MAX_RESTART_BACKOFF_S)
            logger.warning(
                "restarting %s in %g s (restart %d of at most %d)",
                old.name,
                delay,
                old.restarts + 1,
                c.max_engine_restarts,
            )
            await asyncio.sleep(delay)
            new = self._start_engine(old.index)
            new.restarts, new.restarting = old.restarts + 1, True
            self.engines[old.index] = new
            try:
                await asyncio.to_thread(self._wait_ready, [new], time.monotonic() + c.frontend.ready_timeout)
            except ServeError as e:
                reason, old = str(e), new
                continue
            if self.signals.stop:
                return
            new.restarting = False
            loop.add_reader(new.proc.sentinel, self._on_child_exit, loop, new, dead, stop)
            logger.info("%s restarted (pid %d)", new.name, new.proc.pid)
            return

    def _on_child_failed_final(self, ch: _Child, dead: list[_Child], stop: asyncio.Event) -> None:
        if ch.proc.is_alive():
            ch.proc.kill()
        dead.append(ch)
        stop.set()

    # ------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        if self.http_sock is not None:
            self.http_sock.close()
        self._stop_children(self.frontends)
        self._stop_children(self.engines)
        for ch in self.frontends + self.engines:
            if ch.ready_pipe is not None:
                ch.ready_pipe.close()
        if self.shm is not None:
            self.shm.unlink()
            self.shm = None
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def _stop_children(self, children: list[_Child]) -> None:
        if not children:
            return
        for ch in children:
            if ch.proc.is_alive():
                ch.proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (
            any(ch.proc.is_alive() for ch in children)
            and time.monotonic() < deadline
            and not self.signals.force
        ):
            wait_connections([ch.proc.sentinel for ch in children if ch.proc.is_alive()], timeout=0.1)
        for ch in children:
            if ch.proc.is_alive():
                logger.warning("%s (pid %d) did not exit on SIGTERM; killing it", ch.name, ch.proc.pid)
                ch.proc.kill()
            ch.proc.join(STOP_TIMEOUT_S)
        logger.info("%ss stopped (exit codes %s)", children[0].kind, [ch.proc.exitcode for ch in children])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve(config: ServeConfig) -> int:
    """Runs the server until SIGINT/SIGTERM; returns the exit code. Raises
    :class:`ServeError` when it cannot start."""
    return Launcher(config).run()
