"""Dequantizing GGUF tensors to float32, whole tensors at once for the block formats small
chat models ship in (Q4_0, Q4_1, Q8_0), ``gguf.quants`` for the rest; or keeping Q4_0/Q4_1
and Q8_0 matrices quantized (:func:`quantized_blocks`).

``gguf.quants`` splits every tensor into many row groups and dequantizes them one by one;
on the embedded SmolLM2 that is ~3.5 s of a ~10 s start-up. The same arithmetic over the
whole tensor in a few numpy operations takes a fraction of that.

Block layouts (32 weights each, little-endian): Q4_0 = f16 scale ``d`` + 16 bytes of
4-bit codes, weight = d·(q − 8); Q4_1 = f16 ``d`` + f16 minimum ``m`` + 16 bytes, weight =
d·q + m; Q8_0 = f16 ``d`` + 32 int8 codes, weight = d·q. Within a block the low nibbles
hold weights 0–15 and the high nibbles weights 16–31.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from fastsched.model_loader.gguf_container import GGUFTensor


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    return np.concatenate([codes & 0x0F, codes >> 4], axis=1).astype(np.float32)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    return _scale(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8.0)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    return _scale(blocks, 0) * _nibbles(blocks[:, 4:]) + _scale(blocks, 2)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return _scale(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


# format -> (bytes per block, whole-tensor dequantizer)
_FAST = {
    GGMLQuantizationType.Q4_0: (18, _q4_0),
    GGMLQuantizationType.Q4_1: (20, _q4_1),
    GGMLQuantizationType.Q8_0: (34, _q8_0),
}


class Int4Blocks(NamedTuple):
    """A Q4_0/Q4_1 tensor kept quantized, as ``w = scale·(q − 8) + zero`` per block of 32
    (``fastsched.kernels.quant_matmul``'s form): codes ``[N, K]`` uint8 0..15, scale and
    zero ``[N, K/32]`` float32. Converting the fp16 ``d``/``m`` to float32 is exact; for
    Q4_1, ``zero = m + 8d`` rounds once in float32."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray


def int4_type(tensor: GGUFTensor) -> bool:
    """Whether ``tensor`` is a Q4_0 or Q4_1 matrix (what :func:`int4_blocks` keeps 4-bit)."""
    return tensor.tensor_type in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1) and len(tensor.shape) == 2


def int4_blocks(tensor: GGUFTensor) -> Int4Blocks | None:
    """``tensor``'s codes and block parameters if it is Q4_0 or Q4_1 (else None)."""
    if not int4_type(tensor):
        return None
    block_bytes, _ = _FAST[tensor.tensor_type]
    rows, cols = tensor.shape
    blocks = np.ascontiguousarray(tensor.data).reshape(-1, block_bytes)
    scale = _scale(blocks, 0)
    if tensor.tensor_type == GGMLQuantizationType.Q4_0:
        codes, zero = blocks[:, 2:], np.zeros_like(scale)
    else:
        codes, zero = blocks[:, 4:], _scale(blocks, 2) + 8 * scale
    nibbles = np.concatenate([codes & 0x0F, codes >> 4], axis=1)
    groups = cols // 32
    return Int4Blocks(nibbles.reshape(rows, cols), scale.reshape(rows, groups), zero.reshape(rows, groups))


class Int8Blocks(NamedTuple):
    """A Q8_0 tensor kept quantized, ``w = scale·q`` per block of 32
    (``fastsched.kernels.quant_matmul.Int8Weight``): codes ``[N, K]`` int8, scale
    ``[N, K/32]`` float32 (the fp16 ``d`` widened: exact)."""

    codes: np.ndarray
    scale: np.ndarray


def int8_blocks(tensor: GGUFTensor) -> Int8Blocks | None:
    """``tensor``'s codes and scales if it is a Q8_0 matrix (else None)."""
    if tensor.tensor_type != GGMLQuantizationType.Q8_0 or len(tensor.shape) != 2:
        return None
    rows, cols = tensor.shape
    blocks = np.ascontiguousarray(tensor.data).reshape(-1, 34)
    codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
    return Int8Blocks(codes.reshape(rows, cols), _scale(blocks, 0).reshape(rows, cols // 32))


def quantized_blocks(tensor: GGUFTensor) -> Int4Blocks | Int8Blocks | None:
    """What :meth:`GGUFFile.iter_weights` keeps quantized: Q4_0/Q4_1 and Q8_0 matrices."""
    return int4_blocks(tensor) or int8_blocks(tensor)


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """``tensor`` as a float32 array of its shape."""
    if tensor.tensor_type in _FAST:
        block_bytes, blocks_to_floats = _FAST[tensor.tensor_type]
        blocks = np.ascontiguousarray(tensor.data).reshape(-1, block_bytes)
        return blocks_to_floats(blocks).reshape(tensor.shape)
    # A copy: plain float tensors would otherwise be read-only views of the file's memory map.
    return np.array(_gguf_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(tensor.shape)
