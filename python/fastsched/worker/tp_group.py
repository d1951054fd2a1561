"""Rank 0's side of tensor parallelism: starting the other ranks, watching them, stopping them.

``--distributed-executor-backend mp`` starts each rank as a local process
(``python -m fastsched.worker.tp_worker``), which dies with the engine (parent-death
signal); ``ray`` starts each as a Ray actor on a running cluster, placed by a placement
group (one device bundle per rank), and forms the group over the nodes' addresses.

A rank that exits (or whose actor dies) while the engine runs is a failure of the engine:
:attr:`TensorParallelGroup.failure` says which, the engine loop raises it, and the engine
ends as any failed engine does. A rank that hangs (stopped, deadlocked, stuck on its device)
leaves rank 0 waiting in a step's collectives: past ``--execute-model-timeout`` the watch
kills the workers, which fails rank 0's collective at once, and the engine ends the same way
(without the watch, only the ``COLLECTIVE_TIMEOUT`` of the collective itself would end it).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastsched.config import EngineConfig
from fastsched.distributed.parallel import COLLECTIVE_TIMEOUT, TensorParallel
from fastsched.distributed.rendezvous import Rendezvous, listen
from fastsched.distributed.step_channel import StepChannel
from fastsched.worker.ray_placement import place_ranks
from fastsched.worker.tp_worker import WorkerSpec

logger = logging.getLogger(__name__)


def _node_ip() -> str:
    """This machine's address as the other nodes reach it (Ray's, when Ray runs)."""
    import ray

    return ray.util.get_node_ip_address()


class TensorParallelGroup:
    """Ranks 1..N-1 of an engine, and rank 0's :class:`TensorParallel` and :class:`StepChannel`."""

    def __init__(
        self,
        spec: Callable[[int, Rendezvous], WorkerSpec],
        size: int,
        device: torch.device,
        backend: str,
        execute_model_timeout: float = 0.0,
        ray_placement_strategy: str = "PACK",
    ) -> None:
        self.size = size
        self.backend = backend
        self.failure: str | None = None
        self._stopping = False
        rendezvous, store = listen(_node_ip() if backend == "ray" else "127.0.0.1", size, COLLECTIVE_TIMEOUT)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._actors: list[object] = []
        self.nodes: list[str] = []  # with Ray, the node id of each rank
        if backend == "ray":
            self._start_ray(spec, rendezvous, ray_placement_strategy)
        else:
            for rank in range(1, size):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "fastsched.worker.tp_worker"], stdin=subprocess.PIPE
                )
                assert proc.stdin is not None
                with proc.stdin:
                    proc.stdin.write(spec(rank, rendezvous).to_json().encode())
                self._procs.append(proc)
            for rank, proc in enumerate(self._procs, start=1):
                threading.Thread(
                    target=self._watch_process,
                    args=(rank, proc),
                    daemon=True,
                    name=f"fastsched-tp-watch-{rank}",
                ).start()
        self.tp = TensorParallel.join(store, 0, size, device)
        self.channel = StepChannel(self.tp)
        if execute_model_timeout > 0:
            threading.Thread(
                target=self._watch_steps,
                args=(execute_model_timeout,),
                daemon=True,
                name="fastsched-tp-step-watch",
            ).start()

    @property
    def pids(self) -> list[int]:
        """The local worker processes (mp backend)."""
        return [p.pid for p in self._procs]

    def layout(self) -> str:
        """The parallel layout, for the start-up log."""
        where = f"pids {self.pids}" if self._procs else f"{len(self._actors)} Ray actors; nodes {self.nodes}"
        return f"tensor_parallel_size={self.size} ({self.backend}; {dist.get_backend(self.tp.group)}; ranks 1.. {where})"

    def share_num_blocks(self, num_blocks: int) -> None:
        """Tells the ranks the pool size rank 0 chose (every rank holds the same blocks)."""
        dist.broadcast(torch.tensor([num_blocks], dtype=torch.int64), src=0, group=self.tp.cpu_group)
        logger.info("parallel layout: %s", self.layout())

    def check(self) -> None:
        """Raises once a rank has died (the engine loop calls this every turn)."""
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def _watch_steps(self, timeout: float) -> None:
        """Fails the group once rank 0 has waited more than ``timeout`` seconds within one step."""
        while not self._stopping and self.failure is None:
            since = self.channel.waiting_since
            if since is not None and time.monotonic() - since > timeout:
                stopped = [pid for pid in self.pids if _stopped(pid)]
                self.failure = (
                    f"a tensor parallel step waited more than {timeout:g}s for its workers "
                    f"(--execute-model-timeout): a worker hangs"
                    + (f"; stopped worker pids {stopped}" if stopped else "")
                )
                logger.error("%s; killing the workers", self.failure)
                for proc in self._procs:
                    proc.kill()  # rank 0's collective then fails at once
                if self._actors:
                    import ray

                    for actor in self._actors:
                        ray.kill(actor)
                return
            time.sleep(min(1.0, timeout / 8))

    def _watch_process(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._stopping and self.failure is None:
            self.failure = f"tensor parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
            logger.error("%s", self.failure)

    def _start_ray(
        self, spec: Callable[[int, Rendezvous], WorkerSpec], rendezvous: Rendezvous, strategy: str
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
        use_gpu = spec(1, rendezvous).device.startswith("cuda")
        placement = place_ranks(self.size, use_gpu, strategy)
        self._placement_group = placement.group
        self.nodes = placement.nodes
        remote = ray.remote(num_gpus=1 if use_gpu else 0, num_cpus=0 if use_gpu else 1)(_RayRank)
        for rank, bundle in enumerate(placement.bundles, start=1):
            worker = spec(rank, rendezvous)
            if use_gpu:
                worker.device = "cuda:0"  # the actor sees only its own GPU
            where = PlacementGroupSchedulingStrategy(
                placement_group=placement.group, placement_group_bundle_index=bundle
            )
            actor = remote.options(scheduling_strategy=where).remote()
            self._actors.append(actor)
            ref = actor.serve.remote(worker)
            threading.Thread(
                target=self._watch_actor, args=(rank, ref), daemon=True, name=f"fastsched-tp-watch-{rank}"
            ).start()

    def _watch_actor(self, rank: int, ref: object) -> None:
        import ray

        try:
            ray.get(ref)
            error = "returned"
        except Exception as e:  # the actor died or its rank raised
            error = f"failed: {type(e).__name__}: {e}"
        if not self._stopping and self.failure is None:
            self.failure = f"tensor parallel worker rank {rank} (Ray actor) {error}"
            logger.error("%s", self.failure)

    def stop(self, timeout: float = 10.0) -> None:
        """Tells the ranks to stop, waits for them, kills what is left; leaves the group. Once."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is not None:
            timeout = 0.0  # the others wait for a step that will never come
        else:
            try:
                self.channel.send_stop()
            except RuntimeError:
                logger.warning("tensor parallel: a rank did not take the stop message")
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor parallel worker %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        if self._actors:
            import ray
            from ray.util.placement_group import remove_placement_group

            for actor in self._actors:
                ray.kill(actor)
            remove_placement_group(self._placement_group)
        self.tp.leave()


def start_tensor_parallel(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> TensorParallelGroup:
    """Starts ranks 1..N-1 of ``config.tensor_parallel_size`` and joins the group as rank 0.
    On CUDA rank ``r`` takes the device ``r`` places after the engine's."""
    base = device.index or 0

    def spec(rank: int, rendezvous: Rendezvous) -> WorkerSpec:
        return WorkerSpec(
            model=None if config.model is None else str(config.model),
            dtype=str(dtype).removeprefix("torch."),
            device=f"cuda:{base + rank}" if device.type == "cuda" else "cpu",
            quantization=config.resolved_quantization,
            attention_backend=config.attention_backend,
            num_threads=config.num_threads,
            rank=rank,
            size=config.tensor_parallel_size,
            rendezvous=rendezvous,
            host=rendezvous.host,  # local workers: rank 0's (loopback); Ray actors set their node's
            block_size=config.block_size,
            parent_pid=os.getpid() if config.distributed_executor_backend == "mp" else 0,
            lora=(config.max_loras, config.max_lora_rank, config.lora_cpu_capacity)
            if config.enable_lora
            else None,
        )

    return TensorParallelGroup(
        spec,
        config.tensor_parallel_size,
        device,
        config.distributed_executor_backend,
        config.execute_model_timeout,
        config.ray_placement_strategy,
    )


def _stopped(pid: int) -> bool:
    """Whether local process ``pid`` is stopped (SIGSTOP, a debugger), from /proc (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class _RayRank:
    """A Ray actor holding one rank (``--distributed-executor-backend ray``)."""

    def serve(self, spec: WorkerSpec) -> None:
        from fastsched.worker.tp_worker import serve_rank

        spec.host = _node_ip()  # the node this actor was placed on
        serve_rank(spec)
