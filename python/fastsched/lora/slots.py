"""Adapters in fixed device slots, fed from an LRU cache of CPU copies.

The scheduler admits at most ``max_loras`` distinct adapters into the running batch
(S7), so a step never needs more than ``max_loras`` slots. Slot weights are preallocated
once per layer and fused projection (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``), every adapter padded to ``max_lora_rank``: loading an adapter is a copy,
never an allocation, and the model's shapes never change.

Adapters are read from disk only when a request is added (:meth:`LoRAManager.register`),
where a bad file fails that request and nothing else: an adapter that live requests use
keeps its CPU copy (``max_cpu_loras`` bounds the idle ones), so planning a step never
reads a file and never fails for an adapter's sake.

Work is split across the engine's two threads: :meth:`LoRAManager.plan` runs on the
host while the step is prepared (which adapter goes in which slot, from the CPU
copies); :meth:`LoRAManager.activate` runs just before the forward
pass, on the thread that runs them in order, and is the only code that writes the slots.
A step planned while the previous one still runs may thus reuse a slot the previous one
reads: the write happens after that forward pass, never during it.

With tensor parallelism every rank holds its slice of each adapter
(:mod:`fastsched.lora.sharding`) in slots of its own. Rank 0 plans; the other ranks follow
its plan (:meth:`LoRAManager.follow`), which reaches them with the step's inputs
(:mod:`fastsched.lora.step_wire`), reading an adapter from its path themselves when rank 0
copies it into a slot.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from fastsched.lora import step_wire
from fastsched.lora.adapter import LoRAAdapter, load_adapter
from fastsched.lora.punica import DENSE_MAX_TOKENS, bgmv_dense, sgmv
from fastsched.lora.request import LoRARequest
from fastsched.lora.sharding import local_projection_shapes, shard_adapter
from fastsched.models.config import ModelConfig

if TYPE_CHECKING:
    from fastsched.distributed.parallel import TensorParallel

# The model's fused projections and the PEFT modules packed in each, in output order.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class LoRAMapping:
    """One step's plan (host arrays): the adapters to copy into slots first, how the
    tokens map to slots, and which fused projections any of the step's adapters targets."""

    loads: list[tuple[int, LoRAAdapter]]
    # bgmv_dense: per number of shards (1, 2, 3) the [T, S*K] mask of each token's columns.
    masks: dict[int, np.ndarray] | None
    token_slots: np.ndarray | None  # bgmv_triton: [T] int64, -1 for the base model
    groups: list[tuple[int, np.ndarray]] | None  # sgmv: (slot, token indices)
    projections: frozenset[str]
    wire: np.ndarray | None = None  # the plan for the other tensor-parallel ranks (step_wire)


class LoRAStep:
    """What the model reads during one forward pass (:meth:`layer` per decoder layer)."""

    def __init__(
        self,
        stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
        max_lora_rank: int,
        masks: dict[int, torch.Tensor] | None,
        token_slots: torch.Tensor | None,
        groups: list[tuple[int, torch.Tensor]] | None,
        projections: frozenset[str],
        bgmv_triton: Callable[..., None] | None,
    ) -> None:
        self._stacks = stacks
        self._bgmv_triton = bgmv_triton
        self._rank = max_lora_rank
        self._masks = masks
        self._token_slots = token_slots
        self._groups = groups
        self.projections = projections  # the fused projections some adapter of the step changes

    def layer(self, index: int) -> LayerLoRA:
        return LayerLoRA(self, self._stacks[index])

    def add_delta(
        self, projection: str, weights: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, out: torch.Tensor
    ) -> None:
        a, b = weights
        shards = len(FUSED_PROJECTIONS[projection])
        if self._masks is not None:
            bgmv_dense(x, a, b, self._masks[shards], out)
        elif self._token_slots is not None:
            assert self._bgmv_triton is not None
            self._bgmv_triton(x, a, b, shards * self._rank, self._token_slots, out)
        else:
            assert self._groups is not None
            sgmv(x, a, b, shards * self._rank, self._groups, out)


class LayerLoRA:
    """One decoder layer's view of a :class:`LoRAStep`."""

    def __init__(self, step: LoRAStep, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._step = step
        self._weights = weights

    def add(self, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += `` the LoRA delta of fused ``projection`` (a model parameter name) for input ``x``."""
        if projection in self._step.projections:
            self._step.add_delta(projection, self._weights[projection], x, out)


class LoRAManager:
    """Registered adapters (id -> :class:`LoRARequest`), their CPU copies (those of live
    requests, and at most ``max_cpu_loras`` idle ones, LRU) and the ``max_loras`` device slots (LRU among the adapters the
    step at hand does not use). ``kernel`` computes the decode-size steps: ``torch``
    (:func:`~fastsched.lora.punica.bgmv_dense`) or ``triton``
    (:func:`~fastsched.lora.triton_bgmv.bgmv_triton`, the engine's choice on CUDA)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        device: torch.device,
        dtype: torch.dtype,
        kernel: str = "torch",
        tp: TensorParallel | None = None,
    ) -> None:
        if kernel not in ("torch", "triton"):
            raise ValueError(f"LoRA kernel must be torch or triton, got {kernel!r}")
        self.kernel = kernel
        self._bgmv_triton = None
        if kernel == "triton":
            from fastsched.lora.triton_bgmv import bgmv_triton  # imports triton, only where it is used

            self._bgmv_triton = bgmv_triton
        self.config = config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.tp = tp  # this rank's slices of every adapter, in slots of this rank's shapes
        shapes = local_projection_shapes(config, tp)
        self._shapes = shapes
        self.dtype = dtype
        # Per layer and fused projection, a [in, S*K] and b [S*K, out] (fastsched.lora.punica).
        self._stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(config.num_layers):
            layer = {}
            for fused, modules in FUSED_PROJECTIONS.items():
                k = len(modules) * max_lora_rank
                in_features = shapes[modules[0]][0]
                out_features = sum(shapes[m][1] for m in modules)
                layer[fused] = (
                    torch.zeros(in_features, max_loras * k, dtype=dtype, device=device),
                    torch.zeros(max_loras * k, out_features, dtype=dtype, device=device),
                )
            self._stacks.append(layer)
        self._requests: dict[int, LoRARequest] = {}
        self._targets: dict[int, frozenset[str]] = {}  # id -> fused projections it changes
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._live: Counter[int] = Counter()  # id -> live requests using it (acquire / release)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # id -> slot, least recently used first
        self._free_slots = list(range(max_loras - 1, -1, -1))

    @property
    def slot_of(self) -> dict[int, int]:
        """Adapter id -> device slot, as planned for the last step."""
        return dict(self._slot_of)

    @property
    def cpu_cached(self) -> list[int]:
        """Adapter ids with a CPU copy, least recently used first."""
        return list(self._cpu)

    def name_of(self, lora_id: int) -> str:
        return self._requests[lora_id].name

    def register(self, request: LoRARequest) -> None:
        """Makes ``request.id`` known with a CPU copy of its adapter, reading and checking it
        the first time or when the copy was dropped (a bad adapter is a ``ValueError`` that
        fails the request that names it, never a step). One id, one path."""
        known = self._requests.get(request.id)
        if known is not None:
            if known.path != request.path:
                raise ValueError(
                    f"LoRA id {request.id} is adapter {known.name!r} ({known.path}); "
                    f"adapter {request.name!r} names {request.path}"
                )
            if request.id in self._cpu:
                self._cpu.move_to_end(request.id)
                return
        adapter = load_adapter(request.path, request.id, self.config, self.max_lora_rank)
        if self.tp is not None:
            adapter = shard_adapter(adapter, self.config, self.tp)
        self._requests[request.id] = request
        self._targets[request.id] = frozenset(
            fused for fused, modules in FUSED_PROJECTIONS.items() if adapter.target_modules & set(modules)
        )
        self._remember(adapter)

    def acquire(self, lora_id: int) -> None:
        """A live request uses the (registered) adapter: its CPU copy stays until :meth:`release`."""
        self._live[lora_id] += 1

    def release(self, lora_id: int) -> None:
        """A request that used the adapter has ended."""
        self._live[lora_id] -= 1
        if self._live[lora_id] <= 0:
            del self._live[lora_id]
            self._trim()

    def plan(self, lora_ids: np.ndarray, num_scheduled: np.ndarray) -> LoRAMapping | None:
        """The slots of a step whose requests use adapters ``lora_ids`` (0: none), with
        ``num_scheduled`` tokens each; None when no request uses one."""
        if not np.count_nonzero(lora_ids):
            return None
        wanted = np.unique(lora_ids[lora_ids > 0]).tolist()
        if len(wanted) > self.max_loras:
            raise RuntimeError(
                f"a step uses {len(wanted)} LoRA adapters, more than max_loras ({self.max_loras}); "
                "the scheduler's S7 skip should have prevented it"
            )
        loads = []
        req_slots = np.full(len(lora_ids), -1, dtype=np.int64)
        for lora_id in wanted:
            slot = self._slot_of.get(lora_id)
            if slot is None:
                slot = self._take_slot(wanted)
                self._slot_of[lora_id] = slot
                loads.append((slot, self._cpu_copy(lora_id)))
            self._slot_of.move_to_end(lora_id)
            req_slots[lora_ids == lora_id] = slot
        token_slots = np.repeat(req_slots, num_scheduled)
        projections = frozenset().union(*(self._targets[i] for i in wanted))
        mapping = self._mapping(loads, token_slots, projections)
        if self.tp is not None:
            mapping.wire = step_wire.encode(
                [(slot, a.id, self._requests[a.id].path) for slot, a in loads], token_slots, projections
            )
        return mapping

    def follow(self, wire: np.ndarray) -> LoRAMapping:
        """Rank 0's plan of a step (:attr:`LoRAMapping.wire`), on another tensor-parallel rank:
        the same slots, with this rank's slices, read from the adapters' paths when first
        copied in (rank 0 has checked them, so a failure here is the rank's, and ends it)."""
        plan = step_wire.decode(wire)
        loads = []
        for slot, lora_id, path in plan.loads:
            self.register(LoRARequest(f"lora-{lora_id}", lora_id, path))
            loads.append((slot, self._cpu[lora_id]))
        return self._mapping(loads, plan.token_slots, plan.projections)

    def _mapping(
        self, loads: list[tuple[int, LoRAAdapter]], token_slots: np.ndarray, projections: frozenset[str]
    ) -> LoRAMapping:
        """The step's plan in the form its kernel reads (sgmv groups, triton slots or dense masks)."""
        masks = groups = triton_slots = None
        if len(token_slots) > DENSE_MAX_TOKENS:
            groups = [
                (int(s), np.flatnonzero(token_slots == s)) for s in np.unique(token_slots[token_slots >= 0])
            ]
        elif self.kernel == "triton":
            triton_slots = token_slots
        else:
            own = np.zeros((len(token_slots), self.max_loras), dtype=np.float32)
            adapted = np.flatnonzero(token_slots >= 0)
            own[adapted, token_slots[adapted]] = 1.0
            masks = {shards: np.repeat(own, shards * self.max_lora_rank, axis=1) for shards in (1, 2, 3)}
        return LoRAMapping(loads, masks, triton_slots, groups, projections)

    def activate(self, mapping: LoRAMapping) -> LoRAStep:
        """Copies the planned adapters into their slots and returns the step's view. Runs on
        the forward-pass thread, in step order (see the module docstring)."""
        for slot, adapter in mapping.loads:
            self._write_slot(slot, adapter)
        dev = self.device
        masks = token_slots = groups = None
        if mapping.masks is not None:
            masks = {k: torch.from_numpy(m).to(dev, self.dtype) for k, m in mapping.masks.items()}
        if mapping.token_slots is not None:
            token_slots = torch.from_numpy(mapping.token_slots).to(dev)
        if mapping.groups is not None:
            groups = [(slot, torch.from_numpy(rows).to(dev)) for slot, rows in mapping.groups]
        return LoRAStep(
            self._stacks,
            self.max_lora_rank,
            masks,
            token_slots,
            groups,
            mapping.projections,
            self._bgmv_triton,
        )

    def forget_slots(self) -> None:
        """Treats every slot as empty, so the next steps copy their adapters in again: after
        a failed step, whose planned copies (:meth:`activate`) may never have run. Call it
        with no step in flight."""
        self._slot_of.clear()
        self._free_slots = list(range(self.max_loras - 1, -1, -1))

    def _take_slot(self, wanted: list[int]) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next(i for i in self._slot_of if i not in wanted)  # exists: len(wanted) <= max_loras
        return self._slot_of.pop(victim)

    def _cpu_copy(self, lora_id: int) -> LoRAAdapter:
        adapter = self._cpu.get(lora_id)
        if adapter is None:
            raise RuntimeError(
                f"LoRA adapter {lora_id} is scheduled without a CPU copy; every request holds "
                "its adapter's copy from add_request (acquire) to its end (release)"
            )
        self._cpu.move_to_end(lora_id)
        return adapter

    def _remember(self, adapter: LoRAAdapter) -> None:
        self._cpu[adapter.id] = adapter
        self._trim(keep=adapter.id)  # read for a request about to acquire it

    def _trim(self, keep: int | None = None) -> None:
        """Drops the least recently used idle copies (but ``keep``) past ``max_cpu_loras``."""
        idle = [i for i in self._cpu if i not in self._live and i != keep]
        for lora_id in idle[: max(len(self._cpu) - self.max_cpu_loras, 0)]:
            del self._cpu[lora_id]

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Packs the adapter into the fused stacks. A fused projection of ``n`` shards gives
        each slot ``K = n*R`` columns of ``a`` (rows of ``b``); shard ``j`` owns the first
        ``r`` of its ``R`` (the rest stay zero) and its own output columns of ``b``."""
        rank_size = self.max_lora_rank
        for layer, stacks in zip(adapter.weights, self._stacks):
            for fused, modules in FUSED_PROJECTIONS.items():
                a, b = stacks[fused]
                base = slot * len(modules) * rank_size
                a[:, base : base + len(modules) * rank_size] = 0
                b[base : base + len(modules) * rank_size] = 0
                out_start = 0
                for j, module in enumerate(modules):
                    out_size = self._shapes[module][1]
                    if module in layer:
                        lora_a, lora_b = layer[module]
                        cols = slice(base + j * rank_size, base + j * rank_size + lora_a.shape[0])
                        a[:, cols] = lora_a.T
                        b[cols, out_start : out_start + out_size] = lora_b.T
                    out_start += out_size
