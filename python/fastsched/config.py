"""Engine configuration: every knob of model loading, KV sizing and scheduling, validated in one place.

Scheduler knobs keep DESIGN.md's names; ``scheduler_config()`` hands them to the Rust
core, whose own validation names both values of a broken relation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from fastsched._core import SchedulerConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU KV pool when neither --num-gpu-blocks nor --kv-cache-memory is given.
DEFAULT_CPU_KV_CACHE_BYTES = 1024**3


@dataclass
class EngineConfig:
    """What ``fastsched.LLM(...)`` and ``fastsched serve`` accept (as keyword arguments / flags)."""

    model: str | None = None  # HF directory or .gguf file; None = the embedded SmolLM2
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # cpu | cuda | auto
    seed: int = 0  # for requests without their own seed
    attention_backend: str | None = None  # torch | triton | flashinfer; None = automatic
    # Scheduler (DESIGN §3).
    max_num_seqs: int = 256
    max_num_active_seqs: int | None = None
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    prefill_schedule_interval: int = 1
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    priority_preemption: bool = False  # needs policy="priority"
    block_size: int = 16
    enable_prefix_caching: bool = True
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    # Schedule and prepare step N+1 while step N's forward pass runs, N's sampled tokens
    # standing in as placeholders (docs/scheduler.md, "Async scheduling in the engine").
    async_scheduling: bool = True
    # KV pool sizing (DESIGN §3, issue: KV sizing).
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes, CPU
    log_stats_interval: float = 5.0  # seconds between engine stats log lines; 0 = off
    step_trace: str | None = None  # append one JSON line per step here (fastsched.engine.step_trace)
    extra: dict[str, object] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N]; got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2, got {self.num_gpu_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.extra:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(self.extra))}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Like the constructor, but an unknown keyword is an error naming it (not a TypeError trace)."""
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = {k: v for k, v in kwargs.items() if k not in known}
        return cls(**{k: v for k, v in kwargs.items() if k in known}, extra=unknown)  # type: ignore[arg-type]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def resolve_max_model_len(self, model_max: int) -> int:
        if self.max_model_len is None:
            return model_max
        if self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is greater than the model's "
                f"max_position_embeddings ({model_max})"
            )
        return self.max_model_len

    def scheduler_config(self, max_model_len: int, num_gpu_blocks: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_active_seqs=self.max_num_active_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=self.long_prefill_token_threshold_adaptive,
            prefill_schedule_interval=self.prefill_schedule_interval,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.policy,
            priority_preemption=self.priority_preemption,
            block_size=self.block_size,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
            watermark=self.watermark,
        )
