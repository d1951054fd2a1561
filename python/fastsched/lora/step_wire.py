"""Rank 0's LoRA plan of a step as one int64 array, for the other tensor-parallel ranks.

It travels in the step's payload (:class:`fastsched.distributed.step_channel.StepInputs`),
so a step's adapters reach the ranks in the same broadcast as its tokens, never out of
order. It carries what rank 0 decided, not what would let a rank decide again (slot LRU
state, CPU caches): the copies into slots (slot, adapter id, path), each token's slot
(-1: the base model) and the fused projections the step's adapters change.

Layout: ``[T, projections bitmask, number of copies, (slot, id, path bytes) per copy,
the paths' UTF-8 bytes zero-padded to whole int64s, T token slots]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Bit i of the projections mask: the fused projection FUSED_NAMES[i] (those of lora.slots.FUSED_PROJECTIONS).
FUSED_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class WirePlan:
    loads: list[tuple[int, int, str]]  # (slot, adapter id, path), copied in this order
    token_slots: np.ndarray  # [T] int64
    projections: frozenset[str]


def encode(
    loads: list[tuple[int, int, str]], token_slots: np.ndarray, projections: frozenset[str]
) -> np.ndarray:
    mask = sum(1 << i for i, name in enumerate(FUSED_NAMES) if name in projections)
    paths = [path.encode() for _, _, path in loads]
    text = b"".join(paths)
    text += b"\0" * (-len(text) % 8)
    head = [len(token_slots), mask, len(loads)]
    for (slot, lora_id, _), path in zip(loads, paths):
        head += [slot, lora_id, len(path)]
    return np.concatenate(
        [
            np.array(head, dtype=np.int64),
            np.frombuffer(text, dtype=np.int64),
            token_slots.astype(np.int64, copy=False),
        ]
    )


def decode(wire: np.ndarray) -> WirePlan:
    num_tokens, mask, num_loads = (int(v) for v in wire[:3])
    entries = wire[3 : 3 + 3 * num_loads].reshape(num_loads, 3).tolist()
    text_words = -(-sum(n for _, _, n in entries) // 8)
    start = 3 + 3 * num_loads
    text = np.ascontiguousarray(wire[start : start + text_words]).tobytes()
    loads, offset = [], 0
    for slot, lora_id, n in entries:
        loads.append((slot, lora_id, text[offset : offset + n].decode()))
        offset += n
    token_slots = wire[start + text_words : start + text_words + num_tokens]
    projections = frozenset(name for i, name in enumerate(FUSED_NAMES) if mask >> i & 1)
    return WirePlan(loads, token_slots, projections)
