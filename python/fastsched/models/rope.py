"""Rotary position embeddings: the inverse frequencies of each RoPE scaling type we serve,
and the per-step cos/sin tables the decoders rotate q and k with.

Scaling types (``ModelConfig.rope_scaling["rope_type"]``): ``llama3`` (Llama 3.1's
frequency-dependent slow-down), ``linear`` (positions divided by ``factor``, Gemma 3's
global layers) and ``longrope`` (Phi-3's per-frequency factors, ``su`` in older configs).
A partial rotary factor below one rotates only the first part of each head (the rest
passes through unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fastsched.models.config import ModelConfig


def rotary_dim(config: ModelConfig) -> int:
    """How many of a head's dims are rotated (an even number)."""
    return int(config.head_dim * config.partial_rotary_factor) // 2 * 2


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths slowed by ``factor``, short ones kept, the band between blended."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(in_band, blended, scaled)


def _factored_inv_freq(factors: list[float], theta: float, dim: int) -> torch.Tensor:
    """LongRoPE: each frequency's wavelength stretched by its own factor."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta**exponents)


def rope_inv_freq(config: ModelConfig, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32, CPU) for base ``theta`` with ``scaling``; for
    ``longrope`` the short factors' (positions within the original context)."""
    dim = rotary_dim(config)
    inv_freq = _base_inv_freq(theta, dim)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    return _factored_inv_freq(scaling["short_factor"], theta, dim)


class RotaryEmbedding:
    """cos/sin tables for the given positions, computed per step (no max-length table to size).

    ``longrope`` rotates a position below the original context length with the short
    factors and one at or beyond it with the long ones, and scales cos/sin by the
    attention factor: a key's rotation depends on its position alone, so cached keys stay
    valid as a sequence grows past the original context (transformers instead re-rotates
    the whole sequence with the long factors once it is longer)."""

    def __init__(
        self, config: ModelConfig, theta: float | None = None, scaling: dict[str, Any] | None = None
    ) -> None:
        """``theta`` and ``scaling`` default to the config's ``rope_theta`` and ``rope_scaling``
        (a layer with its own base, Gemma 3's sliding ones, passes its own and no scaling)."""
        if theta is None:
            theta, scaling = config.rope_theta, config.rope_scaling
        # Plain tensors, not buffers: the model is built on the meta device and a buffer
        # would come back uninitialized from ``to_empty``.
        self.inv_freq = rope_inv_freq(config, theta, scaling)
        self.long_inv_freq: torch.Tensor | None = None
        self.original_context = 0
        self.attention_factor = 1.0
        if scaling is not None and scaling["rope_type"] == "longrope":
            self.long_inv_freq = _factored_inv_freq(scaling["long_factor"], theta, rotary_dim(config))
            self.original_context = scaling["original_max_position_embeddings"]
            self.attention_factor = longrope_attention_factor(config, scaling)
        self.full_width = rotary_dim(config) == config.head_dim
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            if self.long_inv_freq is not None:
                self.long_inv_freq = self.long_inv_freq.to(positions.device)
        inv_freq = self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            long = (positions >= self.original_context)[:, None]
            inv_freq = torch.where(long, self.long_inv_freq, inv_freq)
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, rotary_dim], broadcast over heads
        if self.attention_factor != 1.0:
            factor = self.attention_factor
            return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """A :class:`Rope` indexing cached ``[len, head_dim]`` tables (CPU), grown (doubling)
        to cover ``positions``. Rows are built by ``__call__`` itself, in chunks small enough
        that torch runs each on one thread and fully vectorized, so a table row has the bits
        the per-step path computes for that position."""
        cos, sin = self._tables.get(dtype, (None, None))
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if cos is None or cos.shape[0] < needed:
            length = max(1024, 1 << (needed - 1).bit_length())
            chunks = [self(torch.arange(i, min(i + 256, length)), dtype) for i in range(0, length, 256)]
            cos = torch.cat([c for c, _ in chunks]).squeeze(1).contiguous()
            sin = torch.cat([s for _, s in chunks]).squeeze(1).contiguous()
            self._tables[dtype] = (cos, sin)
        return Rope(cos, sin, positions.contiguous())


def longrope_attention_factor(config: ModelConfig, scaling: dict[str, Any]) -> float:
    """LongRoPE's cos/sin scale: given, or ``sqrt(1 + ln(factor) / ln(original context))``
    with ``factor`` the context's growth (transformers' default)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


@dataclass
class Rope:
    """A step's RoPE: per-token ``cos``/``sin`` ``[T, 1, rotary_dim]`` (``positions`` None),
    or, for the CPU kernel, ``[len, head_dim]`` tables indexed by ``positions``."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None = None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``[T, heads, head_dim]`` (the Hugging Face layout, not
    interleaved); with tables narrower than the head only its first dims rotate."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    half = width // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
