"""How many KV blocks the pool gets: given, or from the memory left after the model."""

from __future__ import annotations

import dataclasses
import logging

import torch

from fastsched.attention import AttentionBackend, AttentionMetadata
from fastsched.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, cli_fields
from fastsched.models.config import ModelConfig
from fastsched.worker.model_runner import kv_cache_bytes_per_block

logger = logging.getLogger(__name__)


@torch.inference_mode()
def profile_peak_bytes(
    model: torch.nn.Module,
    backend: AttentionBackend,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """Peak CUDA memory of one max-size step (``max_num_batched_tokens`` prefill tokens,
    logits for ``max_num_seqs`` rows), with a throwaway KV cache just big enough for it.

    What the pool may use is then the device's budget minus this peak, so the first
    real full-budget step cannot run out of memory.
    """
    cfg = model.config
    bs = config.block_size
    total = config.max_num_batched_tokens
    lens = [min(max_model_len, total - start) for start in range(0, total, max_model_len)]
    blocks_per_req = [-(-n // bs) for n in lens]
    num_blocks = sum(blocks_per_req) + 1
    kv = [
        torch.empty(2, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        for _ in range(cfg.num_layers)
    ]
    width = max(blocks_per_req)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    slots, positions, first = [], [], 1
    for i, (n, nb) in enumerate(zip(lens, blocks_per_req)):
        tables[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        pos = torch.arange(n)
        positions.append(pos)
        slots.append(tables[i, pos // bs].long() * bs + pos % bs)
        first += nb
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), seq_lens.cumsum(0).int()]).to(device),
        seq_lens=seq_lens.to(device),
        block_tables=tables.to(device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    backend.prepare(metadata)
    hidden = model(
        torch.zeros(total, dtype=torch.long, device=device),
        torch.cat(positions).to(device),
        kv,
        metadata,
        backend,
    )
    model.compute_logits(hidden[: min(config.max_num_seqs, total)]).float()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    kv_bytes = sum(t.numel() * t.element_size() for t in kv)
    del kv, hidden
    torch.cuda.empty_cache()
    return peak - kv_bytes


def kv_pool_blocks(
    model: torch.nn.Module,
    backend: AttentionBackend,
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """The blocks of one rank's KV cache (all of it without tensor parallelism): each rank holds
    every block with its share of the KV heads, so the scheduler sees one pool; where the KV
    heads split unevenly rank 0 holds the most of them, so the pool it sizes fits every rank. On CUDA a
    max-size batch is profiled first; a sharded model cannot run one alone (its collectives
    need every rank), so there the memory its weights take stands for the peak."""
    peak = 0
    if device.type == "cuda" and config.num_gpu_blocks is None:
        peak = (
            profile_peak_bytes(model, backend, config, dtype, device, max_model_len)
            if getattr(model, "tp", None) is None
            else torch.cuda.memory_allocated(device)
        )
    if getattr(model, "tp", None) is not None:
        attn = model.layers[0].self_attn
        model_config = dataclasses.replace(
            model_config, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads
        )
    return determine_num_blocks(config, model_config, dtype, device, max_model_len, peak)


def determine_num_blocks(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    profile_peak_bytes: int = 0,
) -> int:
    """Blocks in the pool, the null block included.

    ``--num-gpu-blocks-override`` wins.  On CUDA the pool takes ``gpu_memory_utilization`` of
    the device minus the peak measured while profiling a max-size batch
    (``profile_peak_bytes``); on CPU it takes ``kv_cache_memory`` bytes (a
    ``gpu_memory_utilization`` set there is warned about: CPU memory is shared with every
    other process, so a fraction of it is no size).  A pool that cannot hold one request of
    a ``--max-model-len`` the user gave is a start-up error; the model's own context length
    is instead cut to what fits (:func:`fit_max_model_len`).  Logs count blocks as
    ``num_gpu_blocks`` does everywhere (the null block included).
    """
    per_block = kv_cache_bytes_per_block(model_config, config.block_size, dtype)
    if config.num_gpu_blocks is not None:
        num_blocks = config.num_gpu_blocks
        source = "--num-gpu-blocks-override"
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * config.gpu_memory_utilization) - profile_peak_bytes
        num_blocks = max(budget, 0) // per_block + 1
        source = (
            f"{config.gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB minus "
            f"{profile_peak_bytes / 2**30:.2f} GiB profiled peak"
        )
    else:
        budget = config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // per_block + 1
        source = f"--kv-cache-memory-bytes {budget / 2**30:.2f} GiB"
        if config.kv_cache_memory is None:
            source += " (the CPU default)"
        _warn_gpu_memory_utilization_on_cpu(config, budget)
    usable_tokens = (num_blocks - 1) * config.block_size
    if usable_tokens < max_model_len and (config.max_model_len is not None or usable_tokens < 2):
        raise ValueError(
            f"the KV cache pool ({num_blocks - 1} blocks x {config.block_size} tokens = {usable_tokens} tokens, "
            f"from {source}) cannot hold one request of max_model_len ({max_model_len}) tokens; "
            "give it more memory or lower --max-model-len"
        )
    logger.info(
        "KV cache: %d blocks (the null block included) of %d tokens = %d usable tokens (%.2f GiB, from %s)",
        num_blocks,
        config.block_size,
        usable_tokens,
        (num_blocks - 1) * per_block / 2**30,
        source,
    )
    return num_blocks


def fit_max_model_len(config: EngineConfig, model_max: int, num_blocks: int) -> int:
    """The engine's ``max_model_len``: ``--max-model-len`` when given (checked against the model
    and the pool already), else the model's context length (``max_position_embeddings``, a
    GGUF file's ``<arch>.context_length``) cut to the tokens the KV pool holds; logs which
    bound applied, and the concurrency that leaves."""
    usable_tokens = (num_blocks - 1) * config.block_size
    if config.max_model_len is not None:
        max_model_len, bound = config.max_model_len, "--max-model-len"
    elif usable_tokens < model_max:
        max_model_len = usable_tokens
        bound = (
            f"the KV cache's {usable_tokens} tokens, below the model's context length {model_max}; "
            "give the cache more memory for longer requests"
        )
    else:
        max_model_len = model_max
        bound = f"the model's context length (the KV cache holds {usable_tokens} tokens)"
    logger.info("max_model_len %d: %s", max_model_len, bound)
    logger.info(
        "Maximum concurrency for %d tokens per request: %.2fx", max_model_len, usable_tokens / max_model_len
    )
    return max_model_len


def _warn_gpu_memory_utilization_on_cpu(config: EngineConfig, budget: int) -> None:
    """``--gpu-memory-utilization`` set on CPU: one warning saying which flag sizes the pool."""
    default = next(f.default for f in cli_fields() if f.name == "gpu_memory_utilization")
    if config.gpu_memory_utilization != default:
        logger.warning(
            "--gpu-memory-utilization %g has no effect on CPU: the KV cache takes --kv-cache-memory-bytes "
            "(%.2f GiB now), as vLLM's CPU backend takes VLLM_CPU_KVCACHE_SPACE",
            config.gpu_memory_utilization,
            budget / 2**30,
        )
