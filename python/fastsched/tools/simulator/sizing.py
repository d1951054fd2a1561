"""The scheduler an engine would build from the same flags, without loading any weights.

``max_model_len`` and the number of KV blocks come from the engine's own functions
(``EngineConfig.resolve_max_model_len``, ``determine_num_blocks``) on the model's
config, so ``fastsched simulate`` and ``fastsched serve`` given the same flags schedule
with the same pool. On CUDA the engine sizes its pool after profiling a forward pass,
which needs the model on the GPU: there ``--num-gpu-blocks-override`` must be given (the engine
logs ``KV blocks=N`` when it is ready).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastsched._core import SchedulerConfig
from fastsched.config import EngineConfig


@dataclass(frozen=True)
class SimulatedEngine:
    scheduler_config: SchedulerConfig
    max_model_len: int
    num_gpu_blocks: int  # the null block included, as SchedulerConfig counts it


def simulated_engine(config: EngineConfig) -> SimulatedEngine:
    from fastsched.model_loader import load_model_config  # reads the config file only
    from fastsched.worker.kv_sizing import determine_num_blocks, fit_max_model_len

    model_config = load_model_config(config.model)
    max_model_len = config.resolve_max_model_len(model_config.max_position_embeddings)
    device = config.torch_device
    if config.num_gpu_blocks is None and device.type == "cuda":
        raise ValueError(
            "on CUDA the engine sizes its KV pool by profiling the model on the GPU; give --num-gpu-blocks-override "
            "(the number an engine logs as `KV blocks=N` when ready) or simulate a CPU engine (--device cpu)"
        )
    num_blocks = determine_num_blocks(config, model_config, config.torch_dtype, device, max_model_len)
    max_model_len = fit_max_model_len(config, max_model_len, num_blocks)
    return SimulatedEngine(config.scheduler_config(max_model_len, num_blocks), max_model_len, num_blocks)
