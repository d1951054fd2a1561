"""Executes the scheduler's decision: one forward pass over a flattened, mixed batch.

The scheduler (Rust) decides which requests compute how many tokens; the runner
turns its arrays into the model's inputs (token ids, positions, KV slot mapping,
block tables) with numpy gathers, runs the model once over all of them, computes
logits only for requests whose prompt is complete, and samples one token each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fastsched._core import SchedulerOutput
from fastsched.attention import AttentionBackend, AttentionMetadata
from fastsched.models.config import ModelConfig
from fastsched.sample import LogprobsTensors, Sampler, SamplingMetadata
from fastsched.sampling_params import SamplingParams
from fastsched.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


@dataclass
class RowState:
    """What sampling needs of one request (the engine owns and updates it)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None


@dataclass
class StepResult:
    """One sampled token per scheduled request (-1 for a partial prefill), and logprobs."""

    tokens: np.ndarray  # [num_scheduled] int64
    sampled_positions: np.ndarray  # indices into the scheduled requests that sampled
    logprobs: LogprobsTensors | None  # rows aligned with sampled_positions


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
    ) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.backend = backend
        self.device = device
        self.block_size = block_size
        cfg = self.config
        # Uninitialised on purpose: attention only reads slots it has written.
        self.kv_caches = [
            torch.empty(2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
            for _ in range(cfg.num_layers)
        ]
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.sampler = Sampler(generator)

    @torch.inference_mode()
    def execute(
        self,
        so: SchedulerOutput,
        tokens_of: Callable[[int], Sequence[int]],
        row_state_of: Callable[[int], RowState],
    ) -> StepResult:
        batch = self.batch
        batch.release(so.finished)
        batch.release(so.preempted)
        n_reqs = len(so)
        if n_reqs == 0:
            empty = np.zeros(0, dtype=np.int64)
            return StepResult(tokens=empty, sampled_positions=empty, logprobs=None)
        rows = batch.update(so, tokens_of)

        num_sched = so.num_scheduled_tokens.astype(np.int64)
        computed = so.num_computed_tokens.astype(np.int64)
        query_start = np.zeros(n_reqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start[1:])
        total = int(query_start[-1])
        req_of_token = np.repeat(np.arange(n_reqs), num_sched)
        positions = np.arange(total) - query_start[req_of_token] + computed[req_of_token]
        token_rows = rows[req_of_token]
        input_ids = batch.token_ids[token_rows, positions]
        bs = self.block_size
        slots = batch.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = computed + num_sched
        max_blocks = int(-(-seq_lens.max() // bs))
        block_tables = batch.block_table[rows, :max_blocks]

        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables)).to(dev),
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
        )
        self.backend.prepare(metadata)
        hidden = self.model(
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(positions).to(dev),
            self.kv_caches,
            metadata,
            self.backend,
        )

        # Only requests whose prompt is now complete produce a token.
        samples = seq_lens >= batch.num_tokens[rows]
        sampled_positions = np.flatnonzero(samples)
        tokens = np.full(n_reqs, -1, dtype=np.int64)
        if len(sampled_positions) == 0:
            return StepResult(tokens=tokens, sampled_positions=sampled_positions, logprobs=None)
        last_token = torch.from_numpy(query_start[1:][sampled_positions] - 1).to(dev)
        logits = self.model.compute_logits(hidden[last_token]).float()
        states = [row_state_of(int(so.req_handles[i])) for i in sampled_positions.tolist()]
        metadata_s = SamplingMetadata.build(
            params=[s.params for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            eos_token_ids=[s.eos_token_ids for s in states],
            generators=[s.generator for s in states],
            vocab_size=logits.shape[-1],
            device=dev,
        )
        out = self.sampler(logits, metadata_s)
        sampled = out.sampled_token_ids.cpu().numpy()
        tokens[sampled_positions] = sampled
        batch.append_tokens(rows[sampled_positions], sampled)
        return StepResult(tokens=tokens, sampled_positions=sampled_positions, logprobs=out.logprobs)
