"""Attention backends behind one contract (``base``), and the choice between them.

Backends are imported only when selected, so importing this package needs
torch alone: a CPU-only install without triton or flashinfer still works,
and the Triton kernels are not compiled (or, in tests, bound to Triton's
interpreter) before a backend that uses them is chosen.
"""

from __future__ import annotations

import importlib.util

import torch

from fastsched.attention.base import AttentionBackend, AttentionMetadata

BACKEND_NAMES = ("torch", "cpu", "triton", "flashinfer")

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "select_backend"]


def select_backend(device: torch.device, override: str | None = None) -> AttentionBackend:
    """The backend for ``device``: ``override`` if given, else the fastest one available.

    Automatic choice: "flashinfer" on CUDA when flashinfer imports, else
    "triton" on CUDA; on the CPU "cpu" (the Rust kernel) when the extension has it,
    else "torch".  An override that is unknown or cannot
    run here raises ValueError saying which and why, at start-up rather than
    at the first forward pass.
    """
    device = torch.device(device)
    name = override if override is not None else _automatic(device)
    if name == "torch":
        from fastsched.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' needs the CPU device, got {device.type!r}")
        from fastsched.attention.cpu import CpuBackend
        from fastsched.kernels import cpu_ops

        if not cpu_ops.AVAILABLE:
            raise ValueError("attention backend 'cpu' is unavailable: fastsched._core lacks paged_attention")
        return CpuBackend()
    if name == "triton":
        _require_cuda(name, device)
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention backend 'triton' is unavailable: the triton package is not installed")
        from fastsched.attention.triton import TritonBackend

        return TritonBackend()
    if name == "flashinfer":
        _require_cuda(name, device)
        from fastsched.attention.flashinfer import FlashInferBackend, flashinfer_available

        if not flashinfer_available():
            raise ValueError("attention backend 'flashinfer' is unavailable: flashinfer cannot be imported")
        return FlashInferBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def _automatic(device: torch.device) -> str:
    if device.type == "cpu":
        from fastsched.kernels import cpu_ops

        return "cpu" if cpu_ops.AVAILABLE else "torch"
    if device.type != "cuda":
        return "torch"
    from fastsched.attention.flashinfer import flashinfer_available

    return "flashinfer" if flashinfer_available() else "triton"


def _require_cuda(name: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device.type!r}")
