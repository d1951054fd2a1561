"""What a tensor-parallel rank other than 0 runs: its shard of the model and of the KV
cache, and the same forward pass as rank 0 for every step rank 0 broadcasts (with its
slices of the step's LoRA adapters), and rank 0's other commands in their turn: a weight
reload, the KV connector's block copies.

Started by ``fastsched.worker.tp_group`` as ``python -m fastsched.worker.tp_worker`` (SPEC on stdin)
(a local process) or as a Ray actor's method (:func:`serve_rank`). It never schedules and
never samples: rank 0 does both, and the logits reach it through the model's gather.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from fastsched.attention import AttentionMetadata, select_backend
from fastsched.cpu_env import configure_threads
from fastsched.distributed.parallel import COLLECTIVE_TIMEOUT, TensorParallel
from fastsched.distributed.rendezvous import Rendezvous
from fastsched.distributed.step_channel import READ_BLOCKS, RELOAD, WRITE_BLOCKS, Command, StepChannel
from fastsched.lora.slots import LoRAManager
from fastsched.model_loader.weights import load_model
from fastsched.worker.kv_blocks import BlockShards, read_blocks, write_blocks
from fastsched.worker.weight_reload import load_checked, swap_in

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What a rank needs to build its shard (JSON on a local worker's stdin: it holds the
    group's secret, which a command line would show every user of the machine)."""

    model: str | None
    dtype: str  # "float32", "bfloat16"...
    device: str  # "cpu", "cuda:1"...
    quantization: str
    attention_backend: str | None
    num_threads: int | None
    rank: int
    size: int
    rendezvous: Rendezvous  # rank 0's store and the group's secret
    host: str  # the address of this rank's node its sockets listen on (a Ray actor sets its own)
    block_size: int
    parent_pid: int  # a local worker dies with the engine (0: no such watch, a Ray actor)
    lora: tuple[int, int, int] | None = None  # (max_loras, max_lora_rank, max_cpu_loras) with enable_lora

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        fields = json.loads(text)
        return cls(**{**fields, "rendezvous": Rendezvous(**fields["rendezvous"])})


def serve_rank(spec: WorkerSpec) -> None:
    """Joins the group, loads this rank's shard, sizes its KV cache as rank 0 says, then runs
    every step and command rank 0 broadcasts until it broadcasts STOP."""
    device = torch.device(spec.device)
    if device.type == "cpu":
        configure_threads(spec.num_threads)
    store = spec.rendezvous.connect(spec.size, COLLECTIVE_TIMEOUT, spec.host)
    tp = TensorParallel.join(store, spec.rank, spec.size, device)
    dtype = getattr(torch, spec.dtype)
    model = load_model(spec.model, dtype=dtype, device=device, quantization=spec.quantization, tp=tp)
    backend = select_backend(device, spec.attention_backend)
    num_blocks = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(num_blocks, src=0, group=tp.cpu_group)  # rank 0 sizes the one pool the scheduler sees
    cfg = model.config
    kv_caches = [
        torch.empty(
            2,
            int(num_blocks.item()),
            spec.block_size,
            model.num_local_kv_heads,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )
        for _ in range(cfg.num_layers)
    ]
    lora = None
    if spec.lora is not None:
        max_loras, max_lora_rank, max_cpu_loras = spec.lora
        lora = LoRAManager(
            cfg,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            device=device,
            dtype=dtype,
            kernel="triton" if device.type == "cuda" else "torch",
            tp=tp,
        )
    shards = BlockShards(tp, cfg, spec.block_size, dtype)
    channel = StepChannel(tp)
    on_device = (
        (lambda a: torch.from_numpy(a).to(device, non_blocking=True))
        if device.type == "cuda"
        else torch.from_numpy
    )
    logger.info(
        "tensor parallel rank %d ready: %d KV blocks of %d KV heads",
        spec.rank,
        num_blocks.item(),
        model.num_local_kv_heads,
    )
    with torch.inference_mode():
        while (step := channel.receive()) is not None:
            if isinstance(step, Command):
                _run_command(step, spec, tp, channel, model, kv_caches, shards)
                continue
            metadata = AttentionMetadata.from_host(step, on_device)
            backend.prepare(metadata)
            adapters = None if step.lora is None or lora is None else lora.activate(lora.follow(step.lora))
            hidden = model(step.input_ids, on_device(step.positions), kv_caches, metadata, backend, adapters)
            if step.compute_logits:  # the same rows as rank 0's ModelRunner.execute, for its gather
                if step.logits_indices is not None:
                    hidden = hidden[on_device(step.logits_indices.astype(np.int64))]
                model.compute_logits(hidden)
    logger.info("tensor parallel rank %d stopping", spec.rank)
    tp.leave()


def _run_command(
    command: Command,
    spec: WorkerSpec,
    tp: TensorParallel,
    channel: StepChannel,
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    shards: BlockShards,
) -> None:
    """A weight reload (this rank's shards of the new checkpoint, swapped in when every rank
    has its own: ``fastsched.worker.weight_reload``) or the KV connector's gather (save) or
    scatter (load) of whole blocks."""
    if command.kind == RELOAD:
        new, error = load_checked(
            command.path,
            model,
            dtype=getattr(torch, spec.dtype),
            device=spec.device,
            quantization=spec.quantization,
            tp=tp,
        )
        if error is not None:
            logger.warning(
                "tensor parallel rank %d: weights from %s not loaded: %s", spec.rank, command.path, error
            )
        if swap_in(model, new, error, channel) is None:
            logger.info("tensor parallel rank %d reloaded weights from %s", spec.rank, command.path)
        return
    assert command.block_ids is not None
    if command.kind == READ_BLOCKS:
        shards.gather(read_blocks(kv_caches, command.block_ids))
    elif command.kind == WRITE_BLOCKS:
        write_blocks(kv_caches, command.block_ids, shards.scatter(None, len(command.block_ids)))
    else:
        raise RuntimeError(f"unknown tensor parallel command {command.kind} from rank 0")


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the engine process dies (Linux), so that no worker outlives it."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # it died before the watch was set
        os._exit(1)


def main() -> int:
    spec = WorkerSpec.from_json(sys.stdin.read())
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [tp rank {spec.rank}] %(message)s"
    )
    if spec.parent_pid:
        _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the engine, which stops us
    try:
        serve_rank(spec)
    except Exception:
        logger.exception("tensor parallel rank %d failed", spec.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
