"""The engine process (docs/design.md §1): one EngineCore behind ZMQ sockets.

It binds a PULL socket at its input address (every frontend pushes ADD / ABORT /
HELLO / QUERY / PAUSE / RELOAD_WEIGHTS and the sessions' STREAM_INPUT / CLOSE_STREAM there)
and connects one PUSH socket to each frontend's output address; a request's outputs go
to the frontend named in its ADD. The loop never blocks while
it has work: it drains the input without waiting, steps, and sends. Idle, it waits on
the input with a short poll timeout so that signals and the parent check still run.
A thread sends every frontend a heartbeat each second, busy or idle. Messages are
``protocol``'s, never pickle.

``start_engine_process`` / ``stop_engine_process(es)`` are the launcher's side: a spawned
(not forked: torch and ZMQ state must not be copied) daemon process running
``run_engine``.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
from tqdm import tqdm

from fastsched.config import EngineConfig, parse_lora_modules
from fastsched.distributed.parallel import data_parallel_devices
from fastsched.engine import protocol
from fastsched.engine.core import EngineCore, NotPausedError
from fastsched.engine.protocol import EngineCoreOutput, EngineStats, ModelInfo, OutputBatch, RequestTiming
from fastsched.engine.status import engine_statuses
from fastsched.models.config import ModelConfig
from fastsched.models.tp_shard import head_ranges
from fastsched.process_stats import read_process_stats

logger = logging.getLogger("fastsched.engine")

IDLE_POLL_MS = 100  # how long an idle loop waits for input before its housekeeping
SEND_HWM = 100_000  # messages queued for one frontend before the engine drops its outputs


def run_engine(
    engine_config: dict[str, Any],
    engine_index: int,
    input_addr: str,
    output_addrs: Sequence[str],
    ready_pipe: Connection | None = None,
    *,
    heartbeat_interval: float = 1.0,
    torch_num_threads: int | None = None,
    log_level: str | int = "INFO",
    kv_events: bool = False,
) -> None:
    """The process main. ``engine_config`` holds :class:`EngineConfig` keyword arguments;
    frontend ``i`` listens at ``output_addrs[i]``. ``ready_pipe`` (optional, for a launcher)
    receives one READY or FAILED message (``protocol``) as bytes. ``kv_events``: send every
    frontend the hashes entering and leaving the prefix cache (KV_EVENTS, ``--routing prefix``).
    Exits 0 on SIGTERM/SIGINT or when the parent process dies, 1 when the engine fails (after
    telling the frontends)."""
    _setup_logging(engine_index, log_level)
    # tqdm's default lock is a multiprocessing semaphore, registered with the launcher's
    # resource tracker, which an engine ending in os._exit never releases: every stop of the
    # server reported it leaked. The loading bars of one process need only a thread lock.
    tqdm.set_lock(threading.RLock())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    parent_pid = os.getppid()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pushes: list[zmq.Socket] = []
    failed = True
    try:
        try:
            pull.bind(input_addr)
            for addr in output_addrs:
                push = ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.SNDHWM, SEND_HWM)
                push.connect(addr)
                pushes.append(push)
            core, info = _build_engine(engine_config, engine_index, torch_num_threads)
        except Exception as e:
            logger.exception("engine %d failed to start", engine_index)
            _report_failure(engine_index, f"engine {engine_index} failed to start: {e}", pushes, ready_pipe)
            return
        loop = _EngineLoop(core, engine_index, pull, pushes, info, kv_events)
        ready = protocol.encode(protocol.Ready(engine_index, info))
        if ready_pipe is not None:
            ready_pipe.send_bytes(ready)
        for frontend in range(len(pushes)):
            loop.send(frontend, ready)
        # The process's one ready line (the launcher and frontends log it at DEBUG only).
        logger.info(
            "engine %d ready (pid %d): model=%s max_model_len=%d vocab_size=%d KV blocks=%d",
            engine_index,
            os.getpid(),
            info.model_name,
            info.max_model_len,
            info.vocab_size,
            info.num_gpu_blocks,
        )
        logger.debug("engine %d: input %s, frontends %s", engine_index, input_addr, list(output_addrs))
        heartbeat = _Heartbeat(ctx, loop, output_addrs, heartbeat_interval)
        heartbeat.start()
        try:
            loop.run(stop, parent_pid)
        except Exception as e:
            logger.exception("engine %d failed", engine_index)
            _report_failure(
                engine_index, f"engine {engine_index} failed: {type(e).__name__}: {e}", pushes, None
            )
            return
        finally:
            heartbeat.stop()
            core.shutdown()
        failed = False
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Exiting already: a repeated signal must not kill the interpreter's
            # finalization (which would turn exit code 0 into -15).
            signal.signal(sig, signal.SIG_IGN)
        for sock in (pull, *pushes):
            sock.close(linger=500 if failed else 0)  # let a FAILED message reach the frontends
        ctx.term()
        if ready_pipe is not None:
            ready_pipe.close()
        logger.info("engine %d exiting", engine_index)
        _exit_process(1 if failed else 0)


def _exit_process(code: int) -> None:
    """Ends the engine process without the interpreter's finalization. Everything that must
    outlive it is done by now (the core shut down, KV connector files written, sockets closed,
    a FAILED message delivered); finalizing a loaded model (collecting the whole unfrozen heap:
    torch, the tokenizer, the GGUF reader's many small arrays) took 4–5 s on the embedded
    SmolLM2, so that a Ctrl-C often ran into the launcher's SIGKILL. An exception on its way
    out is printed first, as the interpreter would have."""
    if sys.exc_info()[1] is not None:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _build_engine(
    engine_config: dict[str, Any], engine_index: int, torch_num_threads: int | None
) -> tuple[EngineCore, ModelInfo]:
    if torch_num_threads is not None and engine_config.get("num_threads") is None:
        # --torch-num-threads (serve's older spelling) is the engine's --num-threads.
        engine_config = {**engine_config, "num_threads": torch_num_threads}
    config = EngineConfig.from_kwargs(**engine_config)
    device = config.torch_device
    if device.type == "cuda":  # data parallelism: each engine (and its workers) on devices of its own
        local_ranks = config.tensor_parallel_size if config.distributed_executor_backend == "mp" else 1
        devices = data_parallel_devices(device, engine_index, local_ranks, torch.cuda.device_count())
        config.device = str(devices[0])
        logger.info("engine %d: devices %s", engine_index, ", ".join(map(str, devices)))
    core = EngineCore(config)
    sc = core.scheduler.config
    model = None if config.model is None else str(config.model)
    info = ModelInfo(
        model=model,
        model_name=_model_name(model),
        max_model_len=core.max_model_len,
        vocab_size=core.vocab_size,
        block_size=sc.block_size,
        num_gpu_blocks=sc.num_gpu_blocks,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        tokenizer=config.tokenizer,
        sampling_defaults=core.sampling_defaults,
        cache_config=_cache_config(config, sc, core.model_config),
        lora_modules=parse_lora_modules(config.lora_modules) if config.enable_lora else None,
        max_lora_rank=config.max_lora_rank,
    )
    return core, info


def _cache_config(config: EngineConfig, sc: Any, model_config: ModelConfig) -> dict[str, str]:
    """The labels of ``cache_config_info`` (vLLM's names; values as text, as vLLM writes them)."""
    heads = [
        head_ranges(model_config, rank, config.tensor_parallel_size)
        for rank in range(config.tensor_parallel_size)
    ]
    return {
        "block_size": str(sc.block_size),
        "num_gpu_blocks": str(sc.num_gpu_blocks),
        "num_gpu_blocks_override": str(config.num_gpu_blocks),
        "enable_prefix_caching": str(bool(sc.enable_prefix_caching)),
        "prefix_caching_hash_algo": sc.prefix_caching_hash_algo,
        "cache_dtype": str(config.torch_dtype).removeprefix("torch."),
        "quantization": config.resolved_quantization,
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "kv_cache_memory_bytes": str(config.kv_cache_memory),
        # The parallel layout: each rank's KV cache holds its share of the KV heads.
        "tensor_parallel_size": str(config.tensor_parallel_size),
        # Each rank's query and KV heads, "6,3" and "2,1" where they split unevenly (tp_shard.head_ranges).
        "num_heads_per_rank": ",".join(str(len(q)) for q, _ in heads),
        "num_kv_heads_per_rank": ",".join(str(len(kv)) for _, kv in heads),
        "distributed_executor_backend": config.distributed_executor_backend,
    }


def _model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def _report_failure(
    engine_index: int, message: str, pushes: list[zmq.Socket], ready_pipe: Connection | None
) -> None:
    data = protocol.encode(protocol.Failed(engine_index, message))
    if ready_pipe is not None:
        try:
            ready_pipe.send_bytes(data)
        except OSError:
            pass
    for push in pushes:
        try:
            push.send(data, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


def _setup_logging(engine_index: int, level: str | int) -> None:
    root = logging.getLogger()
    if not root.handlers:  # a spawned process starts without any
        logging.basicConfig(
            level=level,
            format=f"%(asctime)s %(levelname)s [engine {engine_index}] %(name)s: %(message)s",
        )
    logging.getLogger("fastsched").setLevel(level)


class _EngineLoop:
    def __init__(
        self,
        core: EngineCore,
        engine_index: int,
        pull: zmq.Socket,
        pushes: list[zmq.Socket],
        info: ModelInfo,
        kv_events: bool = False,
    ) -> None:
        self.core = core
        self.kv_events = kv_events
        core.scheduler.record_kv_events(kv_events)
        self.engine_index = engine_index
        self.pull = pull
        self.pushes = pushes
        self.info = info
        self.latest_stats = self._stats()  # read by the heartbeat thread
        self._dropped = [0] * len(pushes)

    def run(self, stop: threading.Event, parent_pid: int) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        core = self.core
        tracer = core.step_tracer  # --step-trace: a served step lasts until the next one starts
        if tracer is not None:
            tracer.use_cycle_timing()
        while not stop.is_set():
            core.check_workers()  # a dead tensor-parallel worker ends the engine
            timeout = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
            if timeout and tracer is not None:
                tracer.on_idle()
            if poller.poll(timeout):
                self._drain()
                self.latest_stats = self._stats()  # an abort frees blocks at once
            if core.has_unfinished_requests():
                outputs = core.step()
                self.latest_stats = self._stats()
                self._send_outputs(outputs)
            if self.kv_events:
                self._send_kv_events()
            if os.getppid() != parent_pid:
                logger.warning("engine %d: parent process %d is gone; exiting", self.engine_index, parent_pid)
                return
        logger.info("engine %d: stop requested", self.engine_index)

    # ------------------------------------------------------------ input

    def _drain(self) -> None:
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = protocol.decode(data)
            except protocol.ProtocolError as e:
                logger.warning("engine %d: dropped a malformed message: %s", self.engine_index, e)
                continue
            if isinstance(msg, protocol.AddRequest):
                self._add(msg)
            elif isinstance(msg, protocol.Abort):
                self.core.abort_requests(msg.request_ids)
            elif isinstance(msg, protocol.Hello):
                if msg.frontend_index < len(self.pushes):
                    self.send(
                        msg.frontend_index, protocol.encode(protocol.Ready(self.engine_index, self.info))
                    )
            elif isinstance(msg, protocol.Query):
                if msg.frontend_index < len(self.pushes):
                    statuses = engine_statuses(self.core.scheduler, msg.request_ids)
                    self.send(
                        msg.frontend_index,
                        protocol.encode(protocol.Status(self.engine_index, msg.query_id, statuses)),
                    )
            elif isinstance(msg, protocol.Pause):
                self._pause(msg)
            elif isinstance(msg, protocol.StreamInput):
                self._stream_input(msg)
            elif isinstance(msg, protocol.CloseStream):
                self._close_stream(msg)
            elif isinstance(msg, protocol.ReloadWeights):
                self._reload_weights(msg)
            elif isinstance(msg, protocol.ResetPrefixCache):
                self.core.reset_prefix_cache()
                if msg.frontend_index < len(self.pushes):
                    self.send(
                        msg.frontend_index,
                        protocol.encode(protocol.PrefixCacheReset(self.engine_index, msg.query_id)),
                    )
            else:
                logger.warning("engine %d: unexpected %s message", self.engine_index, type(msg).__name__)

    def _pause(self, msg: protocol.Pause) -> None:
        """S13, answered once in force: the next schedule() follows the new state."""
        self.core.set_pause_state(msg.state)
        self.latest_stats = self._stats()  # heartbeats from now on carry the new state
        logger.info("engine %d: pause state %s", self.engine_index, msg.state)
        if msg.frontend_index < len(self.pushes):
            self.send(
                msg.frontend_index,
                protocol.encode(protocol.Paused(self.engine_index, msg.query_id, msg.state)),
            )

    def _reload_weights(self, msg: protocol.ReloadWeights) -> None:
        """Answered once loaded (or refused); heartbeats go on from their own thread meanwhile."""
        error: tuple[protocol.ReloadErrorKind, str] | None = None
        try:
            self.core.reload_weights(msg.model)
        except NotPausedError as e:
            error = (protocol.RELOAD_CONFLICT, str(e))
        except Exception as e:  # the checkpoint's fault (weight_reload): the old weights serve on
            error = (protocol.RELOAD_INVALID, f"{type(e).__name__}: {e}")
        if error is not None:
            logger.warning(
                "engine %d: weights from %s not reloaded: %s", self.engine_index, msg.model, error[1]
            )
        if msg.frontend_index < len(self.pushes):
            self.send(
                msg.frontend_index, protocol.encode(protocol.Reloaded(self.engine_index, msg.query_id, error))
            )

    def _close_stream(self, msg: protocol.CloseStream) -> None:
        frontend = self.core.client_of(msg.request_id)
        out = self.core.close_stream(msg.request_id)
        if out is not None and frontend is not None:
            self.send(frontend, protocol.encode(protocol.Outputs(self.engine_index, [out], self._stats())))

    def _stream_input(self, msg: protocol.StreamInput) -> None:
        """S15. Input the engine refuses (the frontend checks it first) ends the session as
        aborted, with the reason, rather than leaving its client waiting for a segment."""
        try:
            self.core.add_stream_input(msg.request_id, msg.token_ids, msg.max_tokens, msg.is_last)
        except (KeyError, ValueError) as e:
            logger.warning("engine %d: stream input for %s refused: %s", self.engine_index, msg.request_id, e)
            frontend = self.core.client_of(msg.request_id)
            self.core.abort_requests([msg.request_id])
            if frontend is not None:
                out = EngineCoreOutput(msg.request_id, [], "abort", error=str(e))
                self.send(
                    frontend, protocol.encode(protocol.Outputs(self.engine_index, [out], self._stats()))
                )

    def _add(self, msg: protocol.AddRequest) -> None:
        request, frontend = msg.request, msg.frontend_index
        if frontend >= len(self.pushes):
            logger.warning(
                "engine %d: request %s names unknown frontend %d",
                self.engine_index,
                request.request_id,
                frontend,
            )
            return
        try:
            self.core.add_request(request, client=frontend)
        except ValueError as e:
            # Answered as ignored (docs/design.md §4), never left unanswered.
            out = EngineCoreOutput(request.request_id, [], "ignored", error=str(e))
            self.send(frontend, protocol.encode(protocol.Outputs(self.engine_index, [out], self._stats())))

    # ------------------------------------------------------------ output

    def _send_outputs(self, batch: OutputBatch) -> None:
        """One OUTPUTS message per frontend with rows in the batch, the columns packed as
        they are; timings only for the rows with a request's first token or its end."""
        if not len(batch):
            return
        finished = batch.finish_reasons != 0
        timings = self._timings(batch, np.flatnonzero((batch.first_token | finished) & (batch.handles >= 0)))
        stats = self._stats()
        frontends = np.unique(batch.clients).tolist()
        for frontend in frontends:
            share = batch if len(frontends) == 1 else batch.select(np.flatnonzero(batch.clients == frontend))
            share_timings = [t for i, t in timings.items() if batch.clients[i] == frontend]
            self.send(
                frontend, protocol.encode(protocol.Outputs(self.engine_index, share, stats, share_timings))
            )

    def _send_kv_events(self) -> None:
        """The prefix cache's changes since the last call, to every frontend (their routing
        summaries); after the step's outputs, so a frontend learns of a request's blocks no
        earlier than of its first token."""
        stored, removed = self.core.scheduler.take_kv_events()
        if len(stored) or len(removed):
            data = protocol.encode(
                protocol.KvEvents(
                    self.engine_index, stored.astype("<u8").tobytes(), removed.astype("<u8").tobytes()
                )
            )
            for frontend in range(len(self.pushes)):
                self.send(frontend, data)

    def _timings(self, batch: OutputBatch, rows: np.ndarray) -> dict[int, RequestTiming]:
        """The timings of ``rows`` (a first token or the end), by row: seconds since arrival."""
        if not len(rows):
            return {}
        arrival, first_scheduled, first_token = self.core.request_times(batch.handles[rows])
        now = time.time()
        e2e = np.where(batch.finish_reasons[rows] != 0, now, np.nan)
        since = [np.maximum(t - arrival, 0.0).tolist() for t in (first_scheduled, first_token, e2e)]
        return {
            row: RequestTiming(batch.request_ids[row], *(None if math.isnan(s[k]) else s[k] for s in since))
            for k, row in enumerate(rows.tolist())
        }

    def _stats(self) -> EngineStats:
        s = self.core.scheduler.stats()
        counters = self.core.stats
        step_fit = self.core.step_time_meter.fit
        return EngineStats(
            num_running=s["num_running"],
            num_waiting=s["num_waiting"],
            kv_cache_usage=float(s["kv_cache_usage"]),
            num_preemptions_total=s["num_preemptions_total"],
            prefix_cache_queries=s["prefix_cache_queries"],
            prefix_cache_hits=s["prefix_cache_hits"],
            prompt_tokens_total=counters.prompt_tokens_total,
            generation_tokens_total=counters.generation_tokens_total,
            scan_stops_total=dict(s["scan_stops_total"]),
            skips_total=dict(s["skips_total"]),
            last_scan_stop=s["last_scan_stop"],
            prefill_tokens_per_s=self.core.prefill_meter.tokens_per_s,
            step_time_base_s=None if step_fit is None else step_fit.base_s,
            step_time_per_token_s=None if step_fit is None else step_fit.per_token_s,
            iteration_tokens=list(counters.iteration_tokens),
            iteration_tokens_sum=counters.iteration_tokens_sum,
            **self._lora_stats(),
            kv_connector=self.core.kv_transfer.stats if self.core.kv_transfer is not None else {},
            pause_state=self.core.pause_state,
            num_waiting_for_streaming_input=s["num_waiting_for_streaming_input"],
            **self._spec_decode_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        core = self.core
        if core.lora is None:
            return {}
        return {
            "running_lora_adapters": core.lora_adapters_of(core.scheduler.running_handles()),
            "waiting_lora_adapters": core.lora_adapters_of(core.scheduler.waiting_handles()),
            "max_lora": core.config.max_loras,
        }

    def _spec_decode_stats(self) -> dict[str, object]:
        spec = self.core.spec_counters
        if spec is None:
            return {}
        return dict(
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos),
        )

    def send(self, frontend: int, data: bytes) -> None:
        """Never blocks: a frontend that stopped reading (gone, or stuck) must not stall
        the others. Past SEND_HWM queued messages its outputs are dropped, with a log line."""
        try:
            self.pushes[frontend].send(data, zmq.NOBLOCK)
        except zmq.Again:
            self._dropped[frontend] += 1
            if self._dropped[frontend] in (1, 10, 100) or self._dropped[frontend] % 1000 == 0:
                logger.warning(
                    "engine %d: frontend %d is not reading; %d messages dropped",
                    self.engine_index,
                    frontend,
                    self._dropped[frontend],
                )


class _Heartbeat(threading.Thread):
    """Sends HEARTBEAT (with the loop's latest stats) to every frontend every interval,
    from sockets of its own, whatever the loop is doing: one step longer than the
    frontends' engine_timeout (a long prefill on CPU) must not read as a dead engine.
    Death of the process stops it; a loop stuck inside a live process is not detected."""

    def __init__(
        self, ctx: zmq.Context, loop: _EngineLoop, output_addrs: Sequence[str], interval: float
    ) -> None:
        super().__init__(name=f"fastsched-engine-{loop.engine_index}-heartbeat", daemon=True)
        self._ctx = ctx
        self._loop = loop
        self._output_addrs = list(output_addrs)
        self._interval = interval
        self._done = threading.Event()

    def run(self) -> None:
        socks = []
        try:
            for addr in self._output_addrs:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 100)  # a gone frontend's heartbeats are worthless
                sock.connect(addr)
                socks.append(sock)
            while not self._done.wait(self._interval):
                process = read_process_stats()  # first: the loop's stats are read just before sending
                stats = msgspec.structs.replace(self._loop.latest_stats, process=process)
                data = protocol.encode(protocol.Heartbeat(self._loop.engine_index, stats))
                for sock in socks:
                    try:
                        sock.send(data, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
        finally:
            for sock in socks:
                sock.close(linger=0)

    def stop(self) -> None:
        self._done.set()
        self.join()


# ------------------------------------------------------------------ launcher side


def start_engine_process(
    engine_config: dict[str, Any],
    engine_index: int,
    input_addr: str,
    output_addrs: Sequence[str],
    **kwargs: Any,
) -> BaseProcess:
    """Spawn a daemon process running :func:`run_engine` (keyword arguments pass through)."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=run_engine,
        args=(dict(engine_config), engine_index, input_addr, list(output_addrs)),
        kwargs=kwargs,
        name=f"fastsched-engine-{engine_index}",
        daemon=True,
    )
    proc.start()
    return proc


def stop_engine_process(proc: BaseProcess, timeout: float = 10.0) -> int | None:
    """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL; returns the exit code."""
    return stop_engine_processes([proc], timeout)[0]


def stop_engine_processes(procs: Sequence[BaseProcess], timeout: float = 10.0) -> list[int | None]:
    """Stop several engines at once (each takes a moment to exit): SIGTERM to all, wait up
    to ``timeout`` seconds in total, SIGKILL what is left; returns the exit codes."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            logger.warning("engine process %s did not exit on SIGTERM; killing it", proc.pid)
            proc.kill()
            proc.join(timeout)
    return [proc.exitcode for proc in procs]
