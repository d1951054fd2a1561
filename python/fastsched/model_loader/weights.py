"""Building the model and loading its weights (the engine's half of model loading; it
needs torch, unlike the rest of ``fastsched.model_loader``)."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode
from tqdm import tqdm

from fastsched.distributed.parallel import TensorParallel
from fastsched.kernels.quant_matmul import GROUP_SIZE, Int4Weight, Int8Weight
from fastsched.model_loader import hf, is_gguf, open_gguf, resolve_model_path
from fastsched.model_loader.gguf_container import GGUFTensor
from fastsched.model_loader.gguf_quants import Int4Blocks, Int8Blocks
from fastsched.models.channel_quant_linear import ChannelQuantLinear, quantize_projections
from fastsched.models.llama import LlamaForCausalLM, target_parameter
from fastsched.models.quant_linear import QuantEmbedding, QuantLinear
from fastsched.models.registry import get_model_class

# --quantization values (vLLM's spelling): gguf keeps a GGUF file's quantized tensors so;
# int4 quantizes a dense checkpoint's linear layers at load (groups of 32), int8 and fp8 its
# projections (one scale a channel); none dequantizes everything.
QUANTIZATIONS = ("gguf", "int4", "int8", "fp8", "none")
# The modes that quantize a dense checkpoint at load (a .gguf file is already quantized).
AT_LOAD = ("int4", "int8", "fp8")

logger = logging.getLogger(__name__)


def iter_hf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint as (Hugging Face name, CPU tensor in its stored dtype),
    one at a time so peak host memory stays at one tensor, with a progress bar."""
    files = hf.weight_files(path)
    handles = [safe_open(str(file), framework="pt", device="cpu") for file in files]
    total = sum(len(handle.keys()) for handle in handles)
    with tqdm(total=total, desc=f"Loading {path.name}", unit="tensor") as progress:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                progress.update(1)


def _from_gguf(name: str, w: object) -> tuple[str, torch.Tensor | Int4Weight | Int8Weight]:
    if isinstance(w, Int4Blocks):
        return name, Int4Weight(*(torch.from_numpy(part) for part in w))
    if isinstance(w, Int8Blocks):
        zero = None if w.zero is None else torch.from_numpy(w.zero)
        return name, Int8Weight(torch.from_numpy(w.codes), torch.from_numpy(w.scale), zero)
    return name, torch.from_numpy(w)  # type: ignore[arg-type]


def _quantize_linears(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """``--quantization int4``: every projection and lm_head weight whose rows split into
    whole groups, quantized round-to-nearest (:meth:`Int4Weight.quantize`)."""
    for name, tensor in weights:
        linear = name.endswith("proj.weight") or name == "lm_head.weight"
        if linear and tensor.dim() == 2 and tensor.shape[1] % GROUP_SIZE == 0:
            yield name, Int4Weight.quantize(tensor)
        else:
            yield name, tensor


# GGML types that are plain floats: read as they are, nothing to keep quantized.
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _plan_gguf(
    bits: dict[str, int], tensors: list[GGUFTensor], hf_name: Callable[[str], str]
) -> tuple[set[str], list[tuple[GGUFTensor, int]]]:
    """Which parameters stay quantized, and the bits each tensor is served with (0: dense).

    A linear layer, lm_head or the embedding stays quantized when every checkpoint tensor of
    it is in a kept format (``bits``, :meth:`GGUFFile.quantized_tensor_names`): then it
    becomes a ``QuantLinear`` / ``QuantEmbedding`` and its dense weight is never allocated.
    Its shards may differ in format: 4-bit if all are (``fuse``), else 8-bit; the embedding is
    8-bit. A layer with a dense shard is dense. ``hf_name``: a tensor's Hugging Face name."""
    shards: dict[str, list[tuple[GGUFTensor, int]]] = {}
    for tensor in tensors:
        name = hf_name(tensor.name)
        shards.setdefault(target_parameter(name), []).append((tensor, bits.get(name, 0)))
    packed, served = set(), []
    for target, group in shards.items():
        linear = target.endswith("proj.weight") or target in ("lm_head.weight", "embed_tokens.weight")
        kept = linear and all(b for _, b in group)
        if kept:
            packed.add(target)
        width = 4 if all(b == 4 for _, b in group) and target != "embed_tokens.weight" else 8
        served += [(tensor, width if kept else 0) for tensor, _ in group]
    return packed, served


def _log_gguf_kept(path: Path, served: list[tuple[GGUFTensor, int]], dtype: torch.dtype) -> None:
    """The start-up lines of a GGUF served quantized: each quantized type's tensors and file
    bytes kept (as int4 / int8), and a warning for those dequantized to ``dtype``."""
    kept: dict[str, tuple[list[int], dict[int, int]]] = {}  # type -> ([tensors, bytes], {bits: tensors})
    dense: dict[str, list[int]] = {}
    for tensor, bits in served:
        kind = tensor.tensor_type.name
        if kind in _FLOAT_TYPES:
            continue
        if bits:
            entry, widths = kept.setdefault(kind, ([0, 0], {}))
            widths[bits] = widths.get(bits, 0) + 1
        else:
            entry = dense.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += tensor.data.nbytes

    def as_widths(widths: dict[int, int]) -> str:
        return ", ".join(f"int{b}" if len(widths) == 1 else f"{n} int{b}" for b, n in sorted(widths.items()))

    if kept:
        logger.info(
            "%s: kept quantized %s",
            path.name,
            "; ".join(
                f"{kind} {n} tensors {size / 2**20:.1f} MiB ({as_widths(widths)})"
                for kind, ((n, size), widths) in sorted(kept.items())
            ),
        )
    if dense:
        count, size = sum(n for n, _ in dense.values()), sum(s for _, s in dense.values())
        parts = ", ".join(
            f"{kind} {n} tensors ({nbytes / 2**20:.1f} MiB)" for kind, (n, nbytes) in sorted(dense.items())
        )
        logger.warning(
            "%s: %d quantized tensors (%.1f MiB) dequantized to %s (no kept form, or a layer "
            "with a dense shard): %s",
            path.name,
            count,
            size / 2**20,
            str(dtype).removeprefix("torch."),
            parts,
        )


class _SkipRandomInit(TorchFunctionMode):
    """Makes the ``torch.nn.init`` calls of module constructors (``reset_parameters``) no-ops
    while the model is built on the meta device. On meta they compute nothing anyway, but in
    torch 2.15 a random init of a meta tensor goes through ``torch._refs``, whose first use
    imports ``torch._dynamo`` and with it inductor, sympy and Triton: ~2.5 s of start-up and
    ~150 MiB of resident memory that the engine never uses (bench/RESULTS.md, "CPU decode:
    engine memory")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _materialize(model: torch.nn.Module, device: torch.device, skip: set[str]) -> None:
    """``to_empty`` but for the parameters in ``skip``, left on the meta device (they are
    replaced by packed 4-bit layers as the weights load)."""
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            full = f"{module_name}.{name}" if module_name else name
            if param is not None and full not in skip:
                module._parameters[name] = torch.nn.Parameter(
                    _empty(param, device), requires_grad=param.requires_grad
                )
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = _empty(buffer, device)


def _empty(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor like ``meta`` on ``device``: ``torch.empty`` from its shape,
    as ``empty_like`` of a meta tensor goes through ``torch._prims_common``, which imports
    sympy (~35 MiB resident) on first use."""
    return torch.empty(meta.shape, dtype=meta.dtype, device=device)


def _release_freed_memory() -> None:
    """Hands the heap freed by load-time temporaries back to the OS (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def check_quantization(quantization: str | None, path: Path) -> str:
    """The quantization to load ``path`` with: None picks gguf for a GGUF file, none otherwise."""
    if quantization is None:
        return "gguf" if is_gguf(path) else "none"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if quantization == "gguf" and not is_gguf(path):
        raise ValueError(f"quantization 'gguf' needs a .gguf file; {path} is not one (use int4 or none)")
    if quantization in AT_LOAD and is_gguf(path):
        raise ValueError(
            f"quantization {quantization!r} quantizes a dense checkpoint; a .gguf file is served "
            "with 'gguf' (its own 4-bit tensors) or 'none'"
        )
    return quantization


def load_model(
    model: str | os.PathLike[str] | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str = "none",
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Build the model for ``model`` in eval mode with weights cast to ``dtype`` on ``device``;
    its ``config`` attribute is the ``ModelConfig`` (EOS ids, ``max_position_embeddings``...).
    ``quantization`` (:data:`QUANTIZATIONS`, checked by :func:`check_quantization`) says which
    linear layers keep 4-bit weights. With ``tp`` the model is this rank's shard: each tensor
    is read and only the rank's slice of it is kept (:mod:`fastsched.models.tp_shard`)."""
    start = time.monotonic()
    path = resolve_model_path(model)
    quantization = check_quantization(quantization, path)
    packed: set[str] = set()  # parameters that will be 4- or 8-bit: never allocated dense
    weights: Iterator[tuple[str, torch.Tensor | Int4Weight | Int8Weight]]
    if is_gguf(path):
        gguf_file = open_gguf(path)
        config = gguf_file.config()
        logger.info(
            "%s holds tensors %s; quantization %s", path.name, gguf_file.quantization_types(), quantization
        )
        weights = (_from_gguf(name, w) for name, w in gguf_file.iter_weights(config, quantization == "gguf"))
        if quantization == "gguf":
            packed, served = _plan_gguf(
                gguf_file.quantized_tensor_names(), gguf_file.weight_tensors(), gguf_file.hf_name
            )
            _log_gguf_kept(path, served, dtype)
    else:
        config = hf.read_config(path)
        hf.weight_files(path)  # a missing file fails before the model is allocated
        dense = iter_hf_weights(path)
        weights = _quantize_linears(dense) if quantization == "int4" else dense
    model_cls = get_model_class(config.architecture)  # an unsupported one fails before any weight is read
    # Built on the meta device so no memory is spent on a random init that the weights overwrite.
    with torch.device("meta"), _SkipRandomInit():
        model = model_cls(config) if tp is None else model_cls(config, tp)
    _materialize(model.to(dtype), torch.device(device), skip=packed)
    with torch.no_grad():
        model.load_weights(weights)
        if quantization in ("int8", "fp8"):
            quantize_projections(model, quantization)
    _release_freed_memory()
    _log_loaded(model, path, dtype, time.monotonic() - start)
    return model.eval()


def _log_loaded(model: torch.nn.Module, path: Path, dtype: torch.dtype, seconds: float) -> None:
    """The start-up line: parameters, which layers are quantized with which kernel, and bytes."""
    packed = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    channel = [m for m in model.modules() if isinstance(m, ChannelQuantLinear)]
    num_params = (
        sum(p.numel() for p in model.parameters())
        + sum(m.weight_packed.in_features * m.weight_packed.out_features for m in packed)
        + sum(m.in_features * m.out_features for m in channel)
    )
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    packed_bytes = sum(m.weight_packed.nbytes() for m in packed)
    packed_bytes += sum(b.numel() * b.element_size() for m in channel for b in m.buffers())
    kernels = sorted({m.weight_packed.kind for m in packed} | {f"{m.kind}:{m.kernel}" for m in channel})
    logger.info(
        "loaded %s (%.0fM parameters, %d layers with group-quantized weights, %d with per-channel 8-bit, "
        "kernels %s) in %.1f s: weights %.0f MiB (%.0f MiB quantized, %.0f MiB in %s)",
        path.name,
        num_params / 1e6,
        len(packed),
        len(channel),
        ",".join(kernels) or "-",
        seconds,
        (dense_bytes + packed_bytes) / 2**20,
        packed_bytes / 2**20,
        dense_bytes / 2**20,
        str(dtype).removeprefix("torch."),
    )
