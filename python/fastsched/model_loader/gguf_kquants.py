"""GGUF block formats re-expressed, exactly, as group-wise integer codes with per-group
parameters over groups of 32 consecutive weights of a row: the forms the quantized matmuls
read, so a file's tensors need no requantization (and no dequantization) to be served.

Two target forms, numpy arrays over a tensor's blocks (``[B, 32·n]`` bytes in, one row of
codes per block out; the caller reshapes to ``[N, K]``):

- 4-bit, ``w = scale·(q − 8) + zero``, ``q`` uint8 0..15 (``fastsched.kernels.quant_matmul``'s
  ``Int4Weight``). Q4_K: a super-block of 256 holds eight sub-blocks of 32 with 6-bit
  scale ``sc`` and minimum ``m`` under fp16 ``d``/``dmin``, ``w = d·sc·q − dmin·m``, so
  ``scale = d·sc`` and ``zero = 8·d·sc − dmin·m``.
- 8-bit, ``w = scale·c + zero``, ``c`` int8 (``zero`` absent where the format has no
  offset: then it is ``Int8Weight``'s ``w = scale·c``, GGUF Q8_0). Q5_0: ``d·(q − 16)``;
  Q5_1: ``d·q + m`` → ``c = q − 16``, ``zero = m + 16·d``; Q5_K as Q4_K with 5-bit codes;
  Q6_K: ``d·s·(q − 32)`` over sub-blocks of 16 with int8 ``s``: a scale ``d·s`` per 16
  columns (the one layout whose scales are not per group of 32).

Every product of an fp16 and a small integer is exact in float32 (≤ 11 + 8 bits of
mantissa); a ``zero`` that subtracts two such products rounds at most once, to float32.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # weights in a K-quant super-block
_SUB = 32  # weights in a group of the target forms


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of each block, as float32 ``[B, 1]``."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes of eight 6-bit scales and eight 6-bit minimums, ``[B, 8]`` each:
    sub-blocks 0–3 in the low 6 bits of bytes 0–3 (scales) and 4–7 (minimums); 4–7 in the
    nibbles of bytes 8–11 with their top two bits in the top bits of bytes 0–3 / 4–7."""
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes in runs of 32 → codes: each run gives 32 codes from its low nibbles, then 32
    from its high nibbles (the K-quants' order). ``[B, 32·r]`` → ``[B, 2r, 32]``."""
    runs = qs.reshape(qs.shape[0], -1, 1, _SUB)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(qs.shape[0], -1, _SUB)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's ``uint32`` of fifth bits, bit ``i`` for weight ``i``: ``[B, 32]`` of 0/16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")
    return (bits << 4).astype(np.uint8)


def q4_k_int4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks (144 bytes: d, dmin, 12 scale bytes, 128 code bytes) → codes ``[B, 256]``
    uint8, scale and zero ``[B, 8]`` float32."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _k_scales(blocks[:, 4:16])
    codes = _low_high_nibbles(blocks[:, 16:144]).reshape(-1, QK_K)
    scale = d * sc
    return codes, scale, 8 * scale - dmin * m


def q5_0_int8(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q5_0 blocks (22 bytes: d, 4 bytes of fifth bits, 16 code bytes) → codes ``[B, 32]``
    int8 in −16..15, scale ``[B, 1]``, no zero."""
    codes = np.concatenate([blocks[:, 6:] & 0x0F, blocks[:, 6:] >> 4], axis=1) | _fifth_bits(blocks[:, 2:6])
    return (codes.astype(np.int16) - 16).astype(np.int8), _f16(blocks, 0), None


def q5_1_int8(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_1 blocks (24 bytes: d, m, fifth bits, codes) → codes in −16..15, scale, zero = m + 16d."""
    codes = np.concatenate([blocks[:, 8:] & 0x0F, blocks[:, 8:] >> 4], axis=1) | _fifth_bits(blocks[:, 4:8])
    d = _f16(blocks, 0)
    return (codes.astype(np.int16) - 16).astype(np.int8), d, _f16(blocks, 2) + 16 * d


def q5_k_int8(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K blocks (176 bytes: d, dmin, 12 scale bytes, 32 bytes of fifth bits, 128 code
    bytes; bit ``j`` of fifth-bit byte ``l`` belongs to weight ``l`` of sub-block ``j``) →
    codes ``[B, 256]`` in −16..15, scale and zero ``[B, 8]`` (zero = 16·d·sc − dmin·m)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48]
    fifth = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    codes = _low_high_nibbles(blocks[:, 48:176]) | fifth
    scale = d * sc
    return (codes.astype(np.int16) - 16).astype(np.int8).reshape(-1, QK_K), scale, 16 * scale - dmin * m


def q6_k_int8(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q6_K blocks (210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
    sub-block scales, d) → codes ``[B, 256]`` in −32..31, scale ``[B, 16]`` (one a sub-block
    of 16 weights), no zero."""
    sub_scales = blocks[:, 192:208].view(np.int8)
    n = blocks.shape[0]
    # Two halves of 128 weights; in each, 64 low-nibble bytes give runs 0–1 (low) and 2–3
    # (high), and 32 high bytes give the top two bits of runs 0..3 at shifts 0, 2, 4, 6.
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, _SUB)
    qh = blocks[:, 128:192].reshape(n, 2, 1, _SUB)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 0x03
    codes = (low | (high << 4)).astype(np.int16) - 32
    scale = _f16(blocks, 208) * sub_scales.astype(np.float32)
    return codes.astype(np.int8).reshape(n, QK_K), scale, None
