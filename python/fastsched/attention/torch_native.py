"""The CPU attention backend: plain torch ops, vectorised per request.

A prefill chunk with context in the cache runs one ``scaled_dot_product_attention``
with a causal mask offset by that context. Chunks with no context (whole short
prompts, the common case when serving) attend only over this step's own keys
and values, so they are batched: padded to the longest of them and run through
one SDPA call with a causal, length-limited mask, instead of one call each.
Decodes (one query token, which sees every key) are the common case at high
concurrency, so they are batched: their keys and values are gathered into
one tensor padded to the longest of them and run through a single SDPA call
with a length mask, instead of one call each.  What depends only on the
step's metadata (which rows are decodes, gather indices, masks) is planned
at the first layer and reused by the others.  Runs on any device, which also
makes it the oracle for the GPU backends.

The decode gather and SDPA dominate a CPU step, both in proportion to the
padded key positions; that decides three things:

- one ``index_select`` gathers keys and values together over slot indices
  (advanced indexing takes ~5x as long for the same copy);
- padding positions read the request's own first key position (0, or with a sliding
  window the window's first), which is always written, so every gathered row is
  finite: a NaN there would survive both the mask and a zero weight (NaN * 0 = NaN),
  and clearing it would take a pass over the whole gathered tensor;
- query heads are grouped by the KV head they read (``[n, H_kv, G, D]``
  against ``[n, H_kv, L, D]``), faster on CPU than ``enable_gqa``.

A layer with a sliding window (``sliding_window``: a query sees its last that many keys,
itself included) gets its own plan a step, whose masks also drop the keys that left the
window; a layer with logit soft-capping (``logits_soft_cap``) runs the same masks through
explicit matmuls and a softmax, as SDPA cannot cap its scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastsched.attention.base import AttentionMetadata

# Cap on key positions gathered per batched-decode SDPA call (requests x
# padded length), so a large batch of long decodes does not allocate the
# padded K/V for all of them at once.
DECODE_GATHER_TOKENS = 1 << 16


@dataclass
class _Prefill:
    """One request's prefill chunk: query rows ``start:end``."""

    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor | None  # [num_blocks] int64; None: no context, attend over this step's K/V
    mask: torch.Tensor | None  # [query_len, seq_len - first_key] bool; None: plain causal
    first_key: int = 0  # the first key position read: 0, or the window's first block's start


@dataclass
class _FreshPrefills:
    """Prefill chunks with no context, attended in one SDPA call over this step's own
    keys and values, padded to ``max_len`` query rows each."""

    gather: torch.Tensor  # [n * max_len] int64, the step's row behind each padded position
    mask: torch.Tensor  # [n, 1, max_len, max_len] bool, causal and within the chunk
    valid: torch.Tensor  # [sum of lengths] int64, the padded positions that are real rows
    rows: torch.Tensor  # [sum of lengths] int64, their rows in the step (same order)
    num: int
    max_len: int


@dataclass
class _DecodeGroup:
    """Single-token requests attended in one SDPA call over keys padded to ``max_len``."""

    rows: torch.Tensor  # [n] int64, query row of each request
    slots: torch.Tensor  # [n * max_len] int64, cache slot of each key position
    mask: torch.Tensor  # [n, 1, 1, max_len] bool, key position < seq_len
    max_len: int


@dataclass
class _StepPlan:
    """Everything a layer needs beyond its tensors: the same for every layer of a step."""

    metadata: AttentionMetadata
    block_size: int
    write_slots: torch.Tensor  # [rows written] int64, the cache slot of each row written
    write_rows: torch.Tensor | None  # the step's rows written, in that order; None: all of them
    prefills: list[_Prefill]  # chunks with context, one SDPA call each
    fresh: _FreshPrefills | None
    decode_groups: list[_DecodeGroup]


class TorchNativeBackend:
    """Attention with torch ops; a Python loop over prefill requests, none over tokens."""

    name = "torch"

    def __init__(self) -> None:
        self._plans: dict[int | None, _StepPlan] = {}  # this step's, by sliding window

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Drop the previous step's plans; the next forward builds this step's."""
        self._plans = {}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V at ``slot_mapping``, then attend causally over the cache
        (over the last ``sliding_window`` keys only, scores soft-capped at ``logits_soft_cap``)."""
        plan = self._plans.get(sliding_window)
        # The block size is known only here; a caller that skips prepare()
        # passes new metadata, which gets its own plan.
        if plan is None or plan.metadata is not metadata or plan.block_size != kv_cache.shape[2]:
            plan = self._plans[sliding_window] = _plan_step(metadata, kv_cache, sliding_window)
        _write_cache(key, value, kv_cache, plan)
        # Contiguous (the model reshapes it to [T, hidden]); padding rows stay zero.
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        cap = logits_soft_cap
        for p in plan.prefills:
            rows = slice(p.start, p.end)
            out[rows] = _prefill(query[rows], key[rows], value[rows], kv_cache, p, scale, cap)
        if plan.fresh is not None:
            fresh = _fresh_prefills(query, key, value, plan.fresh, kv_cache.dtype, scale, cap)
            out.index_copy_(0, plan.fresh.rows, fresh)
        for group in plan.decode_groups:
            rows = query.index_select(0, group.rows)
            out.index_copy_(0, group.rows, _decode(rows, kv_cache, group, scale, cap))
        return out


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` over ``[..., heads, len, head_dim]`` (query heads a
    multiple of the key heads, each group reading one key head), with the scores soft-capped
    (``cap * tanh(s / cap)``) when ``soft_cap`` is set; ``mask`` None: plain causal (square)."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = query.shape[-3] // key.shape[-3]
    if group > 1:
        key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), value)


def _plan_step(metadata: AttentionMetadata, kv_cache: torch.Tensor, window: int | None) -> _StepPlan:
    """Split the step's requests into prefill chunks and decode groups, with their gather indices.

    Which requests decode is found with tensor ops: at high concurrency nearly every
    request does, and a Python loop over them cost more than the rest of the plan."""
    block_size = kv_cache.shape[2]
    query_lens = metadata.query_start_loc.diff()
    starts = metadata.query_start_loc.tolist()
    prefills, fresh = [], []
    for i in torch.nonzero(query_lens > 1).flatten().tolist():
        p = _plan_prefill(
            starts[i], starts[i + 1], int(metadata.seq_lens[i]), metadata.block_tables[i], block_size, window
        )
        (fresh if p.blocks is None else prefills).append(p)
    if len(fresh) == 1:  # alone, its own call needs no padding
        prefills, fresh = prefills + fresh, []
    groups = []
    decodes = torch.nonzero(query_lens == 1).flatten()
    if len(decodes):
        decode_lens = metadata.seq_lens.index_select(0, decodes)
        chunk = max(1, DECODE_GATHER_TOKENS // int(decode_lens.max()))
        for first in range(0, len(decodes), chunk):
            reqs = decodes[first : first + chunk]
            max_len = int(decode_lens[first : first + chunk].max())
            max_len = max_len if window is None else min(max_len, window)
            groups.append(_plan_decode_group(metadata, reqs, max_len, block_size, window))
    slots = metadata.slot_mapping.long()
    padded = slots < 0
    write_rows = torch.nonzero(~padded).flatten() if bool(padded.any()) else None
    write_slots = slots if write_rows is None else slots.index_select(0, write_rows)
    return _StepPlan(
        metadata,
        block_size,
        write_slots,
        write_rows,
        prefills,
        _plan_fresh_prefills(fresh, slots.device, window) if fresh else None,
        groups,
    )


def _write_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
    """``reshape_and_cache_ref`` with the rows to write found once per step, not per layer."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    for i, rows in enumerate((key, value)):
        if plan.write_rows is not None:
            rows = rows.index_select(0, plan.write_rows)
        kv_cache[i].view(-1, num_kv_heads, head_dim).index_copy_(0, plan.write_slots, rows.to(kv_cache.dtype))


def _plan_fresh_prefills(chunks: list[_Prefill], device: torch.device, window: int | None) -> _FreshPrefills:
    lens = torch.tensor([p.end - p.start for p in chunks], device=device)
    starts = torch.tensor([p.start for p in chunks], device=device)
    max_len = int(lens.max())
    offsets = torch.arange(max_len, device=device)
    within = offsets < lens[:, None]  # [n, max_len]
    # Padding repeats the chunk's first row: finite, and masked out as a key.
    gather = starts[:, None] + torch.where(within, offsets, 0)
    causal = offsets[None, :] <= offsets[:, None]  # [query, key]
    if window is not None:  # on real query rows only: a padded row keeps key 0 in sight
        in_window = offsets[:, None] - offsets[None, :] < window
        causal = causal & (in_window | (offsets[:, None] >= lens[:, None, None]))
    mask = causal & within[:, None, :]  # a padded query row still sees the chunk's keys: no empty row
    valid = torch.nonzero(within.flatten()).flatten()
    gather = gather.flatten()
    return _FreshPrefills(gather, mask[:, None], valid, gather.index_select(0, valid), len(chunks), max_len)


def _fresh_prefills(
    query: torch.Tensor,  # [T, num_heads, head_dim], the whole step's
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    f: _FreshPrefills,
    cache_dtype: torch.dtype,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:  # [len(f.rows), num_heads, head_dim], in f.rows' order
    def padded(x: torch.Tensor) -> torch.Tensor:  # [n, heads, max_len, head_dim]
        return x.index_select(0, f.gather).view(f.num, f.max_len, *x.shape[1:]).transpose(1, 2)

    out = attend(
        padded(query), padded(key.to(cache_dtype)), padded(value.to(cache_dtype)), f.mask, scale, soft_cap
    )  # [n, num_heads, max_len, head_dim]
    return out.transpose(1, 2).reshape(f.num * f.max_len, *query.shape[1:]).index_select(0, f.valid)


def _plan_decode_group(
    metadata: AttentionMetadata, reqs: torch.Tensor, max_len: int, block_size: int, window: int | None
) -> _DecodeGroup:
    """The group's gather: keys ``0..max_len`` of each request, or with a window its last
    ``window`` keys only (``max_len`` is then at most ``window``)."""
    device = reqs.device
    rows = metadata.query_start_loc.index_select(0, reqs).long()
    lens = metadata.seq_lens.index_select(0, reqs).long()
    tables = metadata.block_tables.index_select(0, reqs)
    if window is None:
        blocks = tables[:, : -(-max_len // block_size)].long()
        offsets = torch.arange(block_size, device=device)
        slots = (blocks[:, :, None] * block_size + offsets).flatten(1)[:, :max_len]  # [n, max_len]
        key_pos = torch.arange(max_len, device=device).expand(len(reqs), max_len)
    else:
        first = (lens - window).clamp(min=0)
        key_pos = first[:, None] + torch.arange(max_len, device=device)  # [n, max_len]
        in_table = key_pos.clamp(max=tables.shape[1] * block_size - 1)
        slots = tables.long().gather(1, in_table // block_size) * block_size + in_table % block_size
    valid = key_pos < lens[:, None]
    # Padding reads the request's first key position: written, so finite (module docstring).
    slots = torch.where(valid, slots, slots[:, :1])
    return _DecodeGroup(rows, slots.flatten(), valid[:, None, None, :], max_len)


def _plan_prefill(
    start: int, end: int, seq_len: int, block_table: torch.Tensor, block_size: int, window: int | None = None
) -> _Prefill:
    query_len = end - start
    context_len = seq_len - query_len
    windowed = window is not None and window < seq_len
    if context_len == 0 and not windowed:
        return _Prefill(start, end, seq_len, blocks=None, mask=None)
    device = block_table.device
    # With a window, cached blocks wholly before the first query's window are not read.
    first_block = max(0, context_len - window + 1) // block_size if windowed and context_len else 0
    first_key = first_block * block_size
    key_pos = torch.arange(first_key, seq_len, device=device)
    query_pos = context_len + torch.arange(query_len, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if windowed:
        mask = mask & (key_pos[None, :] > query_pos[:, None] - window)
    blocks = None if context_len == 0 else block_table[first_block : -(-seq_len // block_size)].long()
    return _Prefill(start, end, seq_len, blocks, mask=mask, first_key=first_key)


def _prefill(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [query_len, num_kv_heads, head_dim], this step's
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    p: _Prefill,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """One request's chunk: its query row j sits at position seq_len - query_len + j."""
    if p.blocks is None:
        # No context: the chunk's keys are exactly what was just cached.
        keys, values = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    else:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        blocks = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, p.blocks)
        # [2, seq_len - first_key, num_kv_heads, head_dim]
        kv = blocks.view(2, -1, num_kv_heads, head_dim)[:, : p.seq_len - p.first_key]
        keys, values = kv[0], kv[1]
    # [num_heads, query_len, head_dim] against [num_kv_heads, seq_len, head_dim]
    out = attend(query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), p.mask, scale, soft_cap)
    return out.transpose(0, 1)


def _decode(
    query: torch.Tensor,  # [n, num_heads, head_dim], one token per request
    kv_cache: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:  # [n, num_heads, head_dim]
    """One decode group in one SDPA call, query heads grouped by the KV head they read."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    n, num_heads, _ = query.shape
    rows = kv_cache.view(2, -1, num_kv_heads * head_dim).index_select(1, group.slots)
    kv = rows.view(2, n, group.max_len, num_kv_heads, head_dim).transpose(2, 3)  # [2, n, H_kv, L, D]
    # Head h reads kv head h // G: [n, H_kv, G, D] against [n, H_kv, L, D].
    grouped = query.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if soft_cap is None:
        out = F.scaled_dot_product_attention(grouped, kv[0], kv[1], attn_mask=group.mask, scale=scale)
    else:
        out = attend(grouped, kv[0], kv[1], group.mask, scale, soft_cap)
    return out.reshape(n, num_heads, head_dim)
