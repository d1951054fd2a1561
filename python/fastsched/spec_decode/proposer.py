"""Choosing the drafter a ``SpeculativeConfig`` names, checked against the target model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from fastsched.attention import AttentionBackend
from fastsched.model_loader.weights import load_model
from fastsched.models.config import ModelConfig
from fastsched.spec_decode.draft_model import DraftModelProposer
from fastsched.spec_decode.ngram import NgramProposer
from fastsched.speculative_config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        """At most ``k`` drafts (int64) to follow each token sequence."""
        ...


def build_proposer(
    config: SpeculativeConfig,
    target: ModelConfig,
    backend: AttentionBackend,
    *,
    block_size: int,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Proposer:
    """The drafter of ``config``; a draft model must share the target's vocabulary and
    reach ``max_model_len`` positions (``ValueError`` naming both values otherwise)."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    draft = load_model(config.model, dtype=dtype, device=device)
    if draft.config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model's vocab_size ({draft.config.vocab_size}) differs from the "
            f"target model's ({target.vocab_size}): drafts must use the same token ids"
        )
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config.model's max_position_embeddings "
            f"({draft.config.max_position_embeddings}) is below max_model_len ({max_model_len})"
        )
    return DraftModelProposer(draft, backend, k, block_size, device)


def draft_rows(drafts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The drafts as CSR rows (offsets, token ids) in the uint32 arrays
    ``Scheduler.update_draft_token_ids`` takes."""
    offsets = np.zeros(len(drafts) + 1, dtype=np.uint32)
    np.cumsum([len(d) for d in drafts], out=offsets[1:])
    ids = np.concatenate(drafts).astype(np.uint32) if drafts else np.zeros(0, dtype=np.uint32)
    return offsets, ids
