"""Engine configuration: every knob of model loading, KV sizing and scheduling, defined once.

Each field of :class:`EngineConfig` is a keyword argument of ``fastsched.LLM(...)`` and a
flag of every command that runs a model (``add_engine_args`` builds the flags from the
fields, their help text and group, the way vLLM's ``EngineArgs.add_cli_args`` does). The
scheduler's defaults are the Rust core's (``SchedulerConfig::default()``, read through
the binding), so a default is written in one place. Validation lives in one place too:
here for the engine's own knobs, in the core for the scheduler's (its errors name both
values of a broken relation). Importing this module loads no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from fastsched._core import SchedulerConfig
from fastsched.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from fastsched.speculative_config import SpeculativeConfig, parse_speculative_config
from fastsched.units import parse_bytes, parse_count

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
# --quantization values; the ones after gguf quantize a dense checkpoint at load.
QUANTIZATIONS = ("gguf", "int4", "int8", "fp8", "none")
# CPU KV pool when neither --num-gpu-blocks-override nor --kv-cache-memory-bytes is given.
DEFAULT_CPU_KV_CACHE_BYTES = 1024**3

_CORE = SchedulerConfig()  # the Rust core's defaults

MODEL = "model and device"
SCHEDULER = "scheduler (docs/design.md §3)"
KV_CACHE = "KV cache"
ENGINE_LOOP = "engine loop"
SPECULATIVE = "speculative decoding"
LORA = "LoRA adapters (docs/lora.md)"
DIAGNOSTICS = "diagnostics"


def _flag(
    group: str, help: str, *aliases: str, flag: str | None = None, **argparse_kwargs: Any
) -> dict[str, Any]:
    """Field metadata: the flag's group and help text, its name when it is not the field's
    (vLLM's name for the same concept), older spellings kept working for a release
    (``aliases``, listed in docs/serving.md), and any argparse keyword (``type``, ``choices``...)."""
    return {"group": group, "help": help, "aliases": aliases, "flag": flag, "argparse": argparse_kwargs}


def _core_default(name: str) -> Any:
    return getattr(_CORE, name)


@dataclass
class EngineConfig:
    """What ``fastsched.LLM(...)`` and ``fastsched serve`` accept (as keyword arguments / flags)."""

    model: str | None = field(
        default=None,
        metadata=_flag(
            MODEL,
            "HF checkpoint directory, .gguf file, or a Hugging Face repo id already in the local cache "
            "(default: the embedded SmolLM2-135M-Instruct)",
        ),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=_flag(
            MODEL,
            "HF directory, .gguf file or cached repo id to take the tokenizer from (default: the model's)",
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=_flag(
            MODEL,
            "activations and KV cache dtype (auto: bfloat16 on CUDA; on CPU bfloat16 when the weights are quantized "
            "(--quantization other than none) and the CPU computes in bf16 natively (AVX512-BF16/AMX), else float32)",
            choices=("auto", *DTYPES),
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=_flag(
            MODEL,
            "weight quantization: gguf (a .gguf file's Q4_0/Q4_1/Q4_K tensors stay 4-bit; the default for a "
            ".gguf), int4 (a dense checkpoint's linear layers quantized to 4 bits at load, groups of 32), int8 "
            "(its projections to int8 at load, one scale a channel; on CPU torch's int8 kernel, which is slower "
            "than dense bf16: a memory saving, see bench/RESULTS.md), fp8 (the same in float8_e4m3fn; on CPU the "
            "matmul upcasts, a memory saving only; fp8 tensor cores on CUDA sm89+), none (everything dense, in "
            "--dtype; default for a checkpoint directory)",
            "-q",
            choices=QUANTIZATIONS,
        ),
    )
    num_threads: int | None = field(
        default=None,
        metadata=_flag(
            MODEL,
            "CPU intra-op threads (default: OMP_NUM_THREADS if set, else the cores this process may use, "
            "affinity and cgroup quota considered)",
        ),
    )
    device: str = field(
        default="auto", metadata=_flag(MODEL, "cpu, cuda or cuda:N (auto: cuda when available)")
    )
    attention_backend: str | None = field(
        default=None,
        metadata=_flag(
            MODEL,
            "attention implementation (default: flashinfer, else triton on CUDA; cpu, the Rust paged-attention "
            "kernel, on CPU; torch: plain torch ops on any device)",
            choices=("torch", "cpu", "triton", "flashinfer"),
        ),
    )
    seed: int = field(default=0, metadata=_flag(MODEL, "seed for requests that do not set their own"))
    generation_config: str = field(
        default="auto",
        metadata=_flag(
            MODEL,
            "sampling defaults for requests that leave a parameter out: auto (the model's generation_config.json "
            "or GGUF general.sampling.* keys), vllm (fastsched's own), or a directory holding a "
            "generation_config.json",
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_flag(
            MODEL,
            "devices to shard the model over, one worker process each in a torch.distributed group (NCCL on "
            "CUDA, gloo on CPU); the scheduler and sampling stay on the engine (docs/deploy.md)",
            "-tp",
        ),
    )
    distributed_executor_backend: str = field(
        default="mp",
        metadata=_flag(
            MODEL,
            "how tensor-parallel workers start: mp (local processes) or ray (actors of a running Ray cluster, "
            "placed by a placement group; needs the ray extra)",
            choices=("mp", "ray"),
        ),
    )
    ray_placement_strategy: str = field(
        default="PACK",
        metadata=_flag(
            MODEL,
            "with --distributed-executor-backend ray, the placement group's strategy: PACK (the "
            "ranks on as few nodes as fit), STRICT_PACK, SPREAD, or STRICT_SPREAD (every rank on a "
            "node of its own, rank 0 on the engine's)",
            choices=("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"),
        ),
    )
    execute_model_timeout: float = field(
        default=60.0,
        metadata=_flag(
            MODEL,
            "seconds the engine waits for its tensor-parallel workers within one step (or KV block copy) "
            "before it takes a worker for hung, kills the workers and fails, as a dead worker does (vLLM's "
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS); 0: only the 120 s collective timeout",
        ),
    )

    max_num_seqs: int = field(
        default=_core_default("max_num_seqs"), metadata=_flag(SCHEDULER, "model-runner request slots")
    )
    max_num_active_seqs: int | None = field(
        default=None,
        metadata=_flag(SCHEDULER, "cap on requests admitted into RUNNING (default: --max-num-seqs)"),
    )
    max_num_batched_tokens: int = field(
        default=_core_default("max_num_batched_tokens"), metadata=_flag(SCHEDULER, "token budget per step")
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_flag(SCHEDULER, "prompt + output limit per request (default: the model's context length)"),
    )
    long_prefill_token_threshold: int = field(
        default=_core_default("long_prefill_token_threshold"),
        metadata=_flag(
            SCHEDULER, "cap on one long prefill's tokens per step when several requests compete (0: off)"
        ),
    )
    long_prefill_token_threshold_adaptive: bool = field(
        default=_core_default("long_prefill_token_threshold_adaptive"),
        metadata=_flag(SCHEDULER, "raise that cap to the fair share of the budget"),
    )
    prefill_schedule_interval: int = field(
        default=_core_default("prefill_schedule_interval"),
        metadata=_flag(SCHEDULER, "run prefill work only every k-th step while decodes run (1: every step)"),
    )
    enable_chunked_prefill: bool = field(
        default=_core_default("enable_chunked_prefill"),
        metadata=_flag(SCHEDULER, "split a long prompt across steps", "--no-chunked-prefill"),
    )
    policy: str = field(
        default=_core_default("policy"),
        metadata=_flag(
            SCHEDULER,
            "waiting-queue order",
            "--policy",
            flag="--scheduling-policy",
            choices=("fcfs", "priority"),
        ),
    )
    priority_preemption: bool = field(
        default=_core_default("priority_preemption"),
        metadata=_flag(
            SCHEDULER,
            "with --scheduling-policy priority: when the active set is full, a more urgent waiting request "
            "preempts the least urgent running one (recompute, capped per request)",
        ),
    )
    watermark: float = field(
        default=_core_default("watermark"),
        metadata=_flag(SCHEDULER, "fraction of the KV pool kept free when admitting requests"),
    )
    scheduler_reserve_full_isl: bool = field(
        default=_core_default("scheduler_reserve_full_isl"),
        metadata=_flag(
            SCHEDULER, "admit a request only when its whole current sequence fits in free KV blocks (S10)"
        ),
    )
    # Schedule and prepare step N+1 while step N's forward pass runs, N's sampled tokens
    # standing in as placeholders (docs/scheduler.md, "Async scheduling in the engine").
    async_scheduling: bool = field(
        default=True,
        metadata=_flag(
            ENGINE_LOOP, "schedule and prepare step N+1 while step N's forward pass runs (docs/scheduler.md)"
        ),
    )

    # Parsed and checked in __post_init__, whether given as JSON (the flag) or a dict (LLM(...)).
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=_flag(
            SPECULATIVE,
            'JSON as vLLM\'s: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, '
            '"prompt_lookup_max": b} or {"model": DRAFT_DIR, "num_speculative_tokens": k}; turns '
            "async scheduling off",
            type=parse_speculative_config,
            metavar="JSON",
        ),
    )

    block_size: int = field(
        default=_core_default("block_size"), metadata=_flag(KV_CACHE, "tokens per KV block")
    )
    enable_prefix_caching: bool = field(
        default=_core_default("enable_prefix_caching"),
        metadata=_flag(KV_CACHE, "reuse KV blocks of identical prompt prefixes", "--no-prefix-caching"),
    )
    prefix_caching_hash_algo: str = field(
        default=_core_default("prefix_caching_hash_algo"),
        metadata=_flag(
            KV_CACHE,
            "how prefix-cache block hashes are computed: builtin (fast, 64-bit) or sha256 (its first "
            "8 bytes: hashes a client cannot steer into a collision; advised with --kv-transfer-config, "
            "whose store is shared)",
            choices=("builtin", "sha256"),
        ),
    )
    num_gpu_blocks: int | None = field(
        default=None,
        metadata=_flag(
            KV_CACHE,
            "KV blocks in the pool, the null block included (default: from memory)",
            "--num-gpu-blocks",
            flag="--num-gpu-blocks-override",
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_flag(KV_CACHE, "fraction of GPU memory for weights, activations and the KV pool (CUDA)"),
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata=_flag(
            KV_CACHE,
            f"bytes for the KV pool on CPU, e.g. 8MiB (default: {DEFAULT_CPU_KV_CACHE_BYTES // 1024**3} GiB)",
            "--kv-cache-memory",
            flag="--kv-cache-memory-bytes",
            type=parse_bytes,
        ),
    )
    kv_transfer_config: KVTransferConfig | None = field(
        default=None,
        metadata=_flag(
            KV_CACHE,
            'KV connector as JSON, e.g. \'{"kv_connector":"SharedStorageConnector","kv_role":"kv_both",'
            '"kv_connector_extra_config":{"shared_storage_path":"/mnt/kv"}}\'; extra config keys max_size '
            '(default 64GiB), load_timeout_s (30), lookup_timeout_s (1) (README, "Sharing prompt KV through a '
            'store")',
            type=parse_kv_transfer_config,
            metavar="JSON",
        ),
    )

    enable_lora: bool = field(
        default=False,
        metadata=_flag(LORA, "serve PEFT LoRA adapters on top of the model, chosen per request"),
    )
    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            LORA,
            "adapters to serve from the start, as NAME=PATH (a PEFT directory); the OpenAI `model` field "
            "selects one by NAME",
            nargs="+",
            type=str,
            metavar="NAME=PATH",
        ),
    )
    max_loras: int = field(
        default=1,
        metadata=_flag(
            LORA,
            "adapters in one batch, each in a device slot (the scheduler skips a request whose adapter would "
            "exceed it, S7)",
        ),
    )
    max_lora_rank: int = field(default=16, metadata=_flag(LORA, "largest adapter rank accepted (slot size)"))
    max_cpu_loras: int | None = field(
        default=None,
        metadata=_flag(
            LORA, "adapters kept in CPU memory, least recently used evicted (default: --max-loras)"
        ),
    )

    log_stats_interval: float = field(
        default=5.0, metadata=_flag(DIAGNOSTICS, "seconds between engine stats log lines (0: off)")
    )
    step_trace: str | None = field(
        default=None,
        metadata=_flag(
            DIAGNOSTICS,
            "append one JSON line per engine step (shape and duration) to FILE, to fit a step-cost model "
            "with `fastsched bench fit-step-cost` for `fastsched simulate`",
            metavar="FILE",
        ),
    )
    extra: dict[str, object] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        self._check_quantization()
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N]; got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2, got {self.num_gpu_blocks}")
        self._check_tensor_parallel()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.speculative_config is not None:
            self.speculative_config = parse_speculative_config(self.speculative_config)
        self._check_lora()
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.of(self.kv_transfer_config)
            if not self.enable_prefix_caching:
                raise ValueError(
                    "kv_transfer_config needs prefix caching (its blocks are keyed by the "
                    "prefix-cache block hash); drop --no-enable-prefix-caching"
                )
        if self.extra:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(self.extra))}")

    def _check_quantization(self) -> None:
        """What can be told from the flags alone (the file itself is checked at load)."""
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}"
            )
        gguf = self.model is None or str(self.model).endswith(".gguf")
        if self.quantization in ("int4", "int8", "fp8") and gguf:
            raise ValueError(
                f"--quantization {self.quantization} quantizes a dense checkpoint at load; the model "
                f"{self.model or '(embedded SmolLM2 GGUF)'} is a .gguf file: serve it with --quantization "
                "gguf (its own quantized tensors) or none"
            )

    def _check_tensor_parallel(self) -> None:
        """Tensor parallelism's own settings (docs/deploy.md); it combines with every other
        feature, so nothing else is refused here."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.execute_model_timeout < 0:
            raise ValueError(f"execute_model_timeout must be >= 0 seconds, got {self.execute_model_timeout}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be mp or ray; got {self.distributed_executor_backend!r}"
            )

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        self.lora_modules = tuple(self.lora_modules)
        parse_lora_modules(self.lora_modules)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")

    @property
    def lora_cpu_capacity(self) -> int:
        """``max_cpu_loras``, defaulting to ``max_loras``."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Like the constructor, but an unknown keyword is an error naming it (not a TypeError trace)."""
        known = {f.name for f in cli_fields()}
        unknown = {k: v for k, v in kwargs.items() if k not in known}
        return cls(**{k: v for k, v in kwargs.items() if k in known}, extra=unknown)  # type: ignore[arg-type]

    @property
    def torch_device(self) -> torch.device:
        import torch  # only the engine asks; reading flags must not load torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            if self.torch_device.type == "cuda":
                return torch.bfloat16
            from fastsched.cpu_env import cpu_has_bf16

            return (
                torch.bfloat16 if self.resolved_quantization != "none" and cpu_has_bf16() else torch.float32
            )
        return getattr(torch, self.dtype)

    def check_scheduler_knobs(self) -> None:
        """The scheduler's own checks (the core's), run before any process is spawned, with
        what needs the model standing in for the loosest value it can take: ``max_model_len``
        (the model's context length when not given) as its floor of 2 and ``num_gpu_blocks``
        (measured from memory when not given) as 2. A relation with either is checked for real
        when it is given, and again by each engine once the model is known."""
        self.scheduler_config(self.max_model_len or 2, self.num_gpu_blocks or 2)

    @property
    def resolved_quantization(self) -> str:
        """``quantization`` with its default filled in: gguf for a .gguf file (the embedded
        model is one), none otherwise."""
        if self.quantization is not None:
            return self.quantization
        return "gguf" if self.model is None or str(self.model).endswith(".gguf") else "none"

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
        scheduler_knobs = {
            f.name: getattr(self, f.name) for f in cli_fields() if f.metadata["group"] == SCHEDULER
        }
        scheduler_knobs.update(
            max_model_len=max_model_len,
            num_gpu_blocks=num_gpu_blocks,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            max_loras=self.max_loras if self.enable_lora else 0,
        )
        if self.speculative_config is not None:
            scheduler_knobs["num_speculative_tokens"] = self.speculative_config.num_speculative_tokens
        return SchedulerConfig(**scheduler_knobs)


def parse_lora_modules(specs: Iterable[str]) -> dict[str, str]:
    """``["NAME=PATH", ...]`` (``--lora-modules``) -> ``{name: path}``; an entry without
    ``=``, with an empty side, or a name given twice is an error naming it."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules entry {spec!r} must be NAME=PATH")
        if name in modules:
            raise ValueError(f"lora_modules names adapter {name!r} twice")
        modules[name] = path
    return modules


def cli_fields() -> list[Any]:
    """The fields that are engine arguments (all but ``extra``)."""
    return [f for f in fields(EngineConfig) if f.name != "extra"]


_TYPES = {"int": parse_count, "float": float, "str": str}


def add_engine_args(parser: argparse.ArgumentParser, exclude: Iterable[str] = ()) -> None:
    """Add a flag per :class:`EngineConfig` field (but those in ``exclude``) to ``parser``,
    grouped as the fields are; on/off knobs get ``--x/--no-x``."""
    excluded = set(exclude)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in cli_fields():
        if f.name in excluded:
            continue
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(
            meta["group"], parser.add_argument_group(meta["group"])
        )
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        kwargs = dict(meta["argparse"], dest=f.name, default=f.default, help=meta["help"])
        if f.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            for alias in meta["aliases"]:  # an older spelling of the off switch
                group.add_argument(alias, action="store_false", dest=f.name, help=f"same as --no-{flag[2:]}")
            continue
        if "type" not in kwargs:
            kwargs["type"] = _TYPES[f.type.removesuffix(" | None")]
        group.add_argument(flag, *meta["aliases"], **kwargs)


def flag_of(name: str) -> str:
    """The command-line flag of engine argument ``name`` (``max_num_seqs`` -> ``--max-num-seqs``)."""
    for f in cli_fields():
        if f.name == name:
            return f.metadata["flag"] or "--" + name.replace("_", "-")
    raise KeyError(name)


def engine_kwargs(args: argparse.Namespace, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The engine arguments on ``args``, as ``add_engine_args(parser, exclude)`` added them."""
    excluded = set(exclude)
    return {f.name: getattr(args, f.name) for f in cli_fields() if f.name not in excluded}
