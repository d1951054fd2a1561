"""Random calls of the kernel bindings in ``fastsched._core``, valid and broken, run by
test_kernel_boundary_fuzz.py in a child process (``python boundary_fuzz.py NAME``) so that a
crash fails that test instead of killing pytest.

Each fuzzer builds a valid call from drawn sizes, then breaks some of its arguments (wrong
dtype, shape or length, not contiguous, empty, misaligned, a used capsule, not a tensor,
aliasing another argument, ids and slots out of range, repeated requests). A call must
return or raise ValueError / TypeError; a call with nothing broken must return. Before each
call its description is written to ``$BOUNDARY_FUZZ_LAST`` so that a crash names it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.dlpack import to_dlpack

from fastsched import _core

ALLOWED = (ValueError, TypeError)
EXAMPLES = int(os.environ.get("BOUNDARY_FUZZ_EXAMPLES", "120"))
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (of 2, 4 or 8-byte elements) whose data starts one byte past an aligned address."""
    raw = bytearray(t.numel() * t.element_size() + 1)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    out = torch.frombuffer(raw, dtype=ints, offset=1, count=t.numel()).view(t.dtype).reshape(t.shape)
    out.copy_(t)
    return out


def _used_capsule(t: torch.Tensor) -> object:
    capsule = to_dlpack(t)
    torch.from_dlpack(capsule)  # consumes it
    return capsule


def _break(data: st.DataObject, t: torch.Tensor, others: list[torch.Tensor]) -> Any:
    """A broken stand-in for the tensor argument ``t``."""
    kind = data.draw(
        st.sampled_from(
            ["dtype", "shape", "empty", "strided", "misaligned", "capsule", "object", "alias", "values"]
        )
    )
    if kind == "dtype":
        return t.to(data.draw(st.sampled_from([d for d in DTYPES if d != t.dtype])))
    if kind == "shape":
        return data.draw(
            st.sampled_from(
                [
                    t.reshape(-1),
                    t.unsqueeze(0),
                    t[..., :-1] if t.dim() else t,
                    torch.cat([t, t]) if t.dim() else t,
                ]
            )
        )
    if kind == "empty":
        return t[:0] if t.dim() else t.reshape(0)
    if kind == "strided":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype) if t.dim() else t.reshape(1, 1)
        if t.dim():
            wide[..., ::2] = t
        return wide[..., ::2] if t.dim() else wide.t()
    if kind == "misaligned":
        return _misaligned(t) if t.element_size() > 1 and t.numel() else t.to(torch.float64)
    if kind == "capsule":
        return _used_capsule(t)
    if kind == "object":
        return data.draw(st.sampled_from([None, 3, "x", [1, 2], object()]))
    if kind == "alias" and others:
        return data.draw(st.sampled_from(others))
    # "values": ids, slots, positions and lengths anywhere around their valid range
    bad = t.clone()
    if bad.numel() and not bad.is_floating_point() and bad.dtype != torch.bool:
        i = data.draw(st.integers(0, bad.numel() - 1))
        info = torch.iinfo(bad.dtype)
        bad.view(-1)[i] = max(info.min, min(info.max, data.draw(st.integers(-3, 64))))
    return bad


def _seed(data: st.DataObject) -> None:
    """Seeds torch's generator from the example, so that a failing example replays."""
    torch.manual_seed(data.draw(st.integers(0, 2**16)))


def _call(name: str, fn: Callable[..., Any], args: list[Any], broken: bool) -> None:
    """Calls ``fn`` on ``args`` (tensors as fresh capsules): it must return or raise an
    allowed error, and return if nothing was broken."""
    last = os.environ.get("BOUNDARY_FUZZ_LAST")
    if last:
        with open(last, "w") as f:
            f.write(f"{name}: " + ", ".join(_describe(a) for a in args))
    wire = [to_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args]
    try:
        fn(*wire)
    except ALLOWED:
        if not broken:
            raise
    # anything else propagates and fails the fuzzer


def _describe(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return f"{a.dtype} {tuple(a.shape)} strides {a.stride()} at {a.data_ptr() % 16}"
    return repr(a)[:80]


def _fuzz_args(
    data: st.DataObject, name: str, fn: Callable[..., Any], args: list[Any], breakable: list[int]
) -> None:
    """Calls ``fn`` valid, then with some of the ``breakable`` arguments broken."""
    _call(name, fn, args, broken=False)
    chosen = data.draw(st.sets(st.sampled_from(breakable), min_size=1, max_size=3)) if breakable else set()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    bad = [
        (_break(data, a, [o for o in tensors if o is not a]) if i in chosen else a)
        for i, a in enumerate(args)
    ]
    _call(name, fn, bad, broken=True)


def _tensor_indices(args: list[Any]) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(st.data(), st.integers(0, 4), st.integers(1, 9), st.booleans())
def fuzz_act_mul(data: st.DataObject, m: int, inner: int, gelu: bool) -> None:
    _seed(data)
    gate_up = torch.randn(m, 2 * inner).bfloat16()
    args = [gate_up, torch.empty(m, inner, dtype=torch.bfloat16)]
    fn = _core.gelu_tanh_mul_bf16 if gelu else _core.silu_mul_bf16
    _fuzz_args(data, "act_mul", fn, args, _tensor_indices(args))


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(st.data(), st.integers(0, 4), st.integers(1, 24), st.booleans(), st.booleans())
def fuzz_add_rms_norm(data: st.DataObject, m: int, n: int, with_delta: bool, f32_weight: bool) -> None:
    _seed(data)
    weight = torch.rand(n) + 0.5
    args = [
        torch.randn(m, n).bfloat16(),
        torch.randn(m, n).bfloat16() if with_delta else None,
        weight if f32_weight else weight.bfloat16(),
        torch.empty(m, n, dtype=torch.bfloat16),
        1e-6,
    ]
    _fuzz_args(data, "add_rms_norm", _core.add_rms_norm_bf16, args, _tensor_indices(args))


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(st.data(), st.integers(0, 4), st.integers(1, 3), st.integers(1, 4), st.integers(0, 5))
def fuzz_rms_norm_heads(data: st.DataObject, rows: int, heads: int, half: int, extra: int) -> None:
    _seed(data)
    d = 2 * half
    fused = torch.randn(rows, heads * d + extra).bfloat16()
    heads_arg = data.draw(st.sampled_from([heads, heads, heads + 1, 2**40]))
    x = fused[:, : heads * d + data.draw(st.integers(0, extra))]
    args = [x, heads_arg, torch.rand(d).bfloat16(), 1e-6]
    if heads_arg != heads:
        _call("rms_norm_heads", _core.rms_norm_heads_bf16, args, broken=True)
        return
    _fuzz_args(data, "rms_norm_heads", _core.rms_norm_heads_bf16, args, _tensor_indices(args))


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(st.data(), st.integers(0, 4), st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.booleans())
def fuzz_rope(data: st.DataObject, rows: int, heads: int, half: int, table_len: int, bf16: bool) -> None:
    _seed(data)
    d = 2 * half
    dtype = torch.bfloat16 if bf16 else torch.float32
    fused = torch.randn(rows, heads * d + 3).to(dtype)
    positions = torch.randint(0, table_len, (rows,), dtype=torch.int64)
    dims = data.draw(
        st.sampled_from([(heads, d), (heads, d), (heads + 1, d), (heads, d + 2), (2**40, 2**40)])
    )
    args = [
        fused[:, : heads * d],
        *dims,
        positions,
        torch.randn(table_len, d).to(dtype),
        torch.randn(table_len, d).to(dtype),
    ]
    if dims != (heads, d):
        _call("rope", _core.rope, args, broken=True)
        return
    _fuzz_args(data, "rope", _core.rope, args, _tensor_indices(args))


def _step(data: st.DataObject, block_size: int, num_blocks_extra: int) -> tuple[list[torch.Tensor], int, int]:
    """A valid step: (slot_mapping, query_start_loc, seq_lens, block_tables, reqs), T, blocks."""
    lens = data.draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4)), min_size=0, max_size=3))
    reqs_q = [q for q, _ in lens]
    seq = [q + c for q, c in lens]
    max_blocks = max([-(-s // block_size) for s in seq] + [1])
    num_blocks = len(lens) * max_blocks + num_blocks_extra
    order = torch.randperm(num_blocks)
    tables = order[: len(lens) * max_blocks].reshape(len(lens), max_blocks).to(torch.int32)
    qsl = torch.tensor([0] + torch.tensor(reqs_q, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    slots = []
    for i, (q, s) in enumerate(zip(reqs_q, seq)):
        for pos in range(s - q, s):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    reqs = torch.randperm(len(lens)).to(torch.int32)
    return [slot_mapping, qsl, torch.tensor(seq, dtype=torch.int32), tables, reqs], len(slots), num_blocks


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(
    st.data(),
    st.integers(1, 3),
    st.integers(1, 2),
    st.integers(1, 2),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
)
def fuzz_paged_attention(
    data: st.DataObject, block_size: int, kv_heads: int, group: int, half: int, bf16: bool, cache_bf16: bool
) -> None:
    _seed(data)
    d, heads = 2 * half, kv_heads * group
    step, tokens, num_blocks = _step(data, block_size, data.draw(st.integers(0, 2)))
    dtype = torch.bfloat16 if bf16 else torch.float32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    cache_dtype = torch.bfloat16 if cache_bf16 else torch.float32
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, d, dtype=cache_dtype)
    args = [
        q.reshape(tokens, heads, d),
        k.reshape(tokens, kv_heads, d),
        v.reshape(tokens, kv_heads, d),
        torch.empty(tokens, heads, d, dtype=dtype),
        cache,
        *step,
        0.5,
        None,
        None,
    ]
    _fuzz_args(data, "paged_attention", _core.paged_attention, args, _tensor_indices(args))


def _weight_tensors(bits: int, n: int, k: int, scale_group: int, zero: bool) -> list[torch.Tensor | None]:
    data = (
        torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        if bits == 4
        else torch.randint(-128, 128, (n, k), dtype=torch.int8)
    )
    return [data, torch.rand(n, k // scale_group) * 0.01, torch.randn(n, k // 32) * 0.01 if zero else None]


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(
    st.data(),
    st.sampled_from([(4, 32), (8, 32), (8, 16)]),
    st.integers(0, 5),
    st.integers(1, 3),
    st.integers(0, 5),
    st.booleans(),
)
def fuzz_quant(data: st.DataObject, kind: tuple[int, int], n: int, kb: int, m: int, bf16: bool) -> None:
    _seed(data)
    bits, scale_group = kind
    k = 32 * kb
    zero = bits == 4 or data.draw(st.booleans())
    tensors = _weight_tensors(bits, n, k, scale_group, zero)
    new = [bits, scale_group, n, k, *tensors]
    _fuzz_args(data, "QuantWeight", _core.QuantWeight, new, _tensor_indices(new))
    capsules = [None if t is None else to_dlpack(t) for t in tensors]
    weight = _core.QuantWeight(bits, scale_group, n, k, *capsules)
    x = torch.randn(m, k).to(torch.bfloat16 if bf16 else torch.float32)
    call = data.draw(st.sampled_from(["matmul", "gemm", "dequantize"]))
    if call == "matmul":
        args = [weight, x, torch.empty(m, n)]
        _fuzz_args(data, call, _core.quant_matmul, args, _tensor_indices(args))
    elif call == "gemm" and _core.quant_gemm_simd():
        args = [weight, x.bfloat16(), torch.empty(m, n)]
        _fuzz_args(data, call, _core.quant_gemm_bf16, args, _tensor_indices(args))
    else:
        args = [weight, torch.empty(n, k, dtype=torch.bfloat16)]
        _fuzz_args(data, call, _core.quant_dequantize_bf16, args, _tensor_indices(args))


# A tiny stack: hidden 32, 2 query heads and 1 KV head of 16, intermediate 32, int8 weights.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 32, 2, 1, 16, 32


def _decoder(layers: int) -> tuple[_core.CpuDecoder, list[Any]]:
    shapes = [
        ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
        (HIDDEN, HEADS * HEAD_DIM),
        (2 * INTER, HIDDEN),
        (HIDDEN, INTER),
    ]
    keep: list[Any] = []
    weights, norms, biases = [], [], []
    for _ in range(layers):
        ws = []
        for n, k in shapes:
            ts = _weight_tensors(8, n, k, 32, False)
            keep.append(ts)
            ws.append(_core.QuantWeight(8, 32, n, k, to_dlpack(ts[0]), to_dlpack(ts[1])))
        weights.append(ws)
        norms.append(
            [to_dlpack(torch.ones(HIDDEN).bfloat16()), to_dlpack(torch.ones(HIDDEN).bfloat16())] + [None] * 4
        )
        biases.append([None] * 4)
    options = [("silu", None, 0, None, HEAD_DIM**-0.5)] * layers
    stack = _core.CpuDecoder(
        [HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER],
        1e-6,
        16,
        norms,
        weights,
        biases,
        to_dlpack(torch.ones(HIDDEN).bfloat16()),
        options,
    )
    return stack, keep


@settings(max_examples=EXAMPLES // 2, deadline=None, database=None)
@given(st.data(), st.integers(1, 2), st.integers(1, 3))
def fuzz_decoder_forward(data: st.DataObject, layers: int, block_size: int) -> None:
    _seed(data)
    stack, _keep = _decoder(layers)
    step, rows, num_blocks = _step(data, block_size, 1)
    table_len = 8
    positions = torch.tensor([p % table_len for p in range(rows)], dtype=torch.int64)
    caches = [
        torch.zeros(2, num_blocks, block_size, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        for _ in range(layers)
    ]
    cos, sin = torch.randn(table_len, HEAD_DIM).bfloat16(), torch.randn(table_len, HEAD_DIM).bfloat16()
    hidden = torch.randn(rows, HIDDEN).bfloat16()
    out = torch.empty_like(hidden)
    fixed = [hidden, out, positions, *step]

    def forward(h: Any, o: Any, p: Any, *rest: Any) -> None:
        tables = [(to_dlpack(cos), to_dlpack(sin))]
        stack.forward(h, o, p, tables, [to_dlpack(c) for c in cache_args], *rest, rows)

    cache_args: list[Any] = caches
    _fuzz_args(data, "CpuDecoder.forward", forward, fixed, _tensor_indices(fixed))
    # a cache list that is short, of another shape, or a weight's tensor aliasing a cache
    cache_args = data.draw(st.sampled_from([caches[:-1], [c[:, :, :1] for c in caches], [out] * layers]))
    args = [hidden, torch.empty_like(hidden), positions, *step]
    _call("CpuDecoder.forward caches", forward, args, broken=True)


FUZZERS = {
    f.__name__.removeprefix("fuzz_"): f
    for f in (
        fuzz_act_mul,
        fuzz_add_rms_norm,
        fuzz_rms_norm_heads,
        fuzz_rope,
        fuzz_paged_attention,
        fuzz_quant,
        fuzz_decoder_forward,
    )
}

if __name__ == "__main__":
    torch.manual_seed(0)
    FUZZERS[sys.argv[1]]()
