"""Dequantizing GGUF tensors to float32, whole tensors at once for the block formats small
chat models ship in (Q4_0, Q4_1, Q8_0), ``gguf.quants`` for the rest; and reading the
formats kept quantized (:func:`quantized_blocks`: Q4_0, Q4_1, Q4_K as 4-bit; Q5_0, Q5_1,
Q5_K, Q6_K and Q8_0 as 8-bit) as codes and per-block parameters.

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

from fastsched.model_loader import gguf_kquants
from fastsched.model_loader.gguf_container import GGUFTensor


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


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
    """A 4-bit tensor kept quantized, as ``w = scale·(q − 8) + zero`` per block of 32
    (``fastsched.kernels.quant_matmul``'s form): codes ``[N, K]`` uint8 0..15, scale and
    zero ``[N, K/32]`` float32. Converting the fp16 ``d``/``m`` to float32 is exact; for
    Q4_1, ``zero = m + 8d`` rounds once in float32 (Q4_K: ``gguf_kquants``)."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray


class Int8Blocks(NamedTuple):
    """A 5-, 6- or 8-bit tensor as ``w = scale·c + zero`` (``gguf_kquants``, ``Int8Weight``'s
    form): codes ``[N, K]`` int8, scale ``[N, K/32]`` float32 (Q6_K: ``[N, K/16]``), zero
    ``[N, K/32]`` or None where the format has no offset (Q5_0, Q6_K, Q8_0)."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None


def _q4_0_int4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale = _scale(blocks, 0)
    return np.concatenate([blocks[:, 2:] & 0x0F, blocks[:, 2:] >> 4], axis=1), scale, np.zeros_like(scale)


def _q4_1_int4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale = _scale(blocks, 0)
    return (
        np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1),
        scale,
        _scale(blocks, 2) + 8 * scale,
    )


def _q8_0_int8(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return blocks[:, 2:].view(np.int8), _scale(blocks, 0), None


# format -> (bytes per block, blocks -> (codes, scale, zero)); every block converts exactly.
_INT4 = {
    GGMLQuantizationType.Q4_0: (18, _q4_0_int4),
    GGMLQuantizationType.Q4_1: (20, _q4_1_int4),
    GGMLQuantizationType.Q4_K: (144, gguf_kquants.q4_k_int4),
}
_INT8 = {
    GGMLQuantizationType.Q5_0: (22, gguf_kquants.q5_0_int8),
    GGMLQuantizationType.Q5_1: (24, gguf_kquants.q5_1_int8),
    GGMLQuantizationType.Q5_K: (176, gguf_kquants.q5_k_int8),
    GGMLQuantizationType.Q6_K: (210, gguf_kquants.q6_k_int8),
    GGMLQuantizationType.Q8_0: (34, _q8_0_int8),
}


def int4_type(tensor: GGUFTensor) -> bool:
    """Whether ``tensor`` is a Q4_0, Q4_1 or Q4_K matrix (what :func:`int4_blocks` keeps 4-bit)."""
    return tensor.tensor_type in _INT4 and len(tensor.shape) == 2


def _convert(tensor: GGUFTensor, table: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    if tensor.tensor_type not in table or len(tensor.shape) != 2:
        return None
    block_bytes, convert = table[tensor.tensor_type]
    rows, cols = tensor.shape
    codes, scale, zero = convert(np.ascontiguousarray(tensor.data).reshape(-1, block_bytes))
    return (
        codes.reshape(rows, cols),
        scale.reshape(rows, -1),
        None if zero is None else zero.reshape(rows, cols // 32),
    )


def int4_blocks(tensor: GGUFTensor) -> Int4Blocks | None:
    """``tensor``'s codes and block parameters if it is Q4_0, Q4_1 or Q4_K (else None)."""
    converted = _convert(tensor, _INT4)
    return None if converted is None else Int4Blocks(*converted)  # type: ignore[arg-type]


def int8_blocks(tensor: GGUFTensor) -> Int8Blocks | None:
    """``tensor`` as 8-bit codes and block parameters if it is Q5_0, Q5_1, Q5_K, Q6_K or Q8_0
    (else None)."""
    converted = _convert(tensor, _INT8)
    return None if converted is None else Int8Blocks(*converted)


# What ``quantized_blocks`` keeps quantized, by format, with its bits: every block of these
# formats converts exactly (the other formats, Q2_K, Q3_K, the IQ ones..., are dequantized).
KEPT_BITS = {
    **dict.fromkeys(_INT4, 4),
    **dict.fromkeys(_INT8, 8),
}


def quantized_blocks(tensor: GGUFTensor) -> Int4Blocks | Int8Blocks | None:
    """What :meth:`GGUFFile.iter_weights` keeps quantized (:data:`KEPT_BITS`), else None."""
    if tensor.tensor_type not in KEPT_BITS or len(tensor.shape) != 2:
        return None
    return int4_blocks(tensor) if KEPT_BITS[tensor.tensor_type] == 4 else int8_blocks(tensor)


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """``tensor`` as a float32 array of its shape."""
    if tensor.tensor_type in _FAST:
        block_bytes, blocks_to_floats = _FAST[tensor.tensor_type]
        blocks = np.ascontiguousarray(tensor.data).reshape(-1, block_bytes)
        return blocks_to_floats(blocks).reshape(tensor.shape)
    # A copy: plain float tensors would otherwise be read-only views of the file's memory map.
    return np.array(_gguf_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(tensor.shape)
