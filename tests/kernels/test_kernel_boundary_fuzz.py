"""The kernel bindings check what they are given (docs/architecture.md, "Kernel boundary"):
random calls, valid and broken, return or raise ValueError / TypeError and never crash the
process (tests/kernels/boundary_fuzz.py, run in a child process), and each hole the
boundary once had fails with an error naming the bad argument."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from fastsched import _core
from fastsched.kernels import cpu_ops
from fastsched.kernels.quant_matmul_cpu import CpuQuantWeight

sys.path.insert(0, str(Path(__file__).parent))
import boundary_fuzz

DRIVER = Path(__file__).with_name("boundary_fuzz.py")


@pytest.mark.parametrize("name", sorted(boundary_fuzz.FUZZERS))
def test_random_calls_return_or_raise_and_never_crash(name: str, tmp_path: Path) -> None:
    last = tmp_path / "last_call"
    env = dict(os.environ, BOUNDARY_FUZZ_LAST=str(last), BOUNDARY_FUZZ_EXAMPLES="100")
    proc = subprocess.run(
        [sys.executable, str(DRIVER), name], env=env, capture_output=True, text=True, timeout=600
    )
    crashed = f"; last call: {last.read_text()}" if proc.returncode < 0 and last.exists() else ""
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}{crashed}\n{output}"


def _step(
    qsl: list[int], seq_lens: list[int], reqs: list[int], tables: list[list[int]], slots: list[int]
) -> tuple[torch.Tensor, ...]:
    i32 = torch.int32
    return (
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(qsl, dtype=i32),
        torch.tensor(seq_lens, dtype=i32),
        torch.tensor(tables, dtype=i32),
        torch.tensor(reqs, dtype=i32),
    )


def _attend(tokens: int, step: tuple[torch.Tensor, ...], num_blocks: int = 4) -> None:
    q = torch.randn(tokens, 2, 8)
    kv = torch.randn(tokens, 1, 8)
    cache = torch.zeros(2, num_blocks, 2, 1, 8)
    cpu_ops.paged_attention(q, kv, kv.clone(), torch.empty_like(q), cache, step, 0.35)


def test_a_step_that_attends_returns() -> None:
    _attend(3, _step([0, 2, 3], [2, 1], [0, 1], [[0, 1], [2, 3]], [0, 1, 4]))


def test_query_start_loc_must_have_one_more_row_than_seq_lens() -> None:
    # it was never checked against seq_lens: a short one was read past its end
    with pytest.raises(ValueError, match="query_start_loc has 2"):
        _attend(3, _step([0, 2], [2, 1], [0, 1], [[0, 1], [2, 3]], [0, 1, 4]))


def test_a_request_listed_twice_is_rejected() -> None:
    # two pool tasks would write its rows at once
    with pytest.raises(ValueError, match="request 0 twice"):
        _attend(3, _step([0, 2, 3], [2, 1], [0, 0], [[0, 1], [2, 3]], [0, 1, 4]))


def test_requests_whose_query_rows_overlap_are_rejected() -> None:
    # request 0 owns rows 0..2, request 2 rows 1..3 (request 1 is not attended)
    with pytest.raises(ValueError, match="overlapping query rows"):
        _attend(3, _step([0, 2, 1, 3], [2, 0, 2], [0, 2], [[0], [1], [2]], [0, 1, 4]))


def test_block_ids_and_slots_outside_the_cache_are_rejected() -> None:
    with pytest.raises(ValueError, match="block_tables holds 9"):
        _attend(3, _step([0, 2, 3], [2, 1], [0, 1], [[9, 1], [2, 3]], [0, 1, 4]))
    with pytest.raises(ValueError, match="slot_mapping holds 8"):
        _attend(3, _step([0, 2, 3], [2, 1], [0, 1], [[0, 1], [2, 3]], [0, 1, 8]))


def test_the_eager_quant_matmul_checks_the_activation_shape() -> None:
    codes = torch.randint(-128, 128, (4, 64), dtype=torch.int8)
    weight = CpuQuantWeight(8, (codes, torch.rand(4, 2)), 4, 64)
    assert weight.matmul(torch.randn(3, 64)).shape == (3, 4)
    with pytest.raises(ValueError, match="x has 96 elements"):
        weight.matmul(torch.randn(3, 32))
    with pytest.raises(ValueError, match="x must have 2 dims"):
        weight.matmul(torch.randn(64))


def test_empty_tensors_return_without_touching_their_address() -> None:
    # torch gives an empty tensor a null data pointer
    empty = torch.empty(0, 8, dtype=torch.bfloat16)
    assert empty.data_ptr() == 0
    assert cpu_ops.silu_mul(torch.empty(0, 8, dtype=torch.bfloat16)).shape == (0, 4)
    assert cpu_ops.add_rms_norm(empty, None, torch.ones(8, dtype=torch.bfloat16), 1e-6).shape == (0, 8)
    cpu_ops.rope_(
        empty,
        1,
        8,
        torch.empty(0, dtype=torch.int64),
        torch.ones(2, 8).bfloat16(),
        torch.ones(2, 8).bfloat16(),
    )
    slots, qsl, seq_lens, _, reqs = _step([0], [], [], [], [])
    _attend(0, (slots, qsl, seq_lens, torch.empty(0, 1, dtype=torch.int32), reqs))
    weight = CpuQuantWeight(8, (torch.zeros(4, 32, dtype=torch.int8), torch.rand(4, 1)), 4, 32)
    assert weight.matmul(torch.empty(0, 32)).shape == (0, 4)


def test_a_misaligned_tensor_is_rejected() -> None:
    raw = bytearray(2 * 16 + 1)
    gate_up = torch.frombuffer(raw, dtype=torch.int16, offset=1, count=16).view(torch.bfloat16).reshape(2, 8)
    with pytest.raises(ValueError, match="gate_up's data .* is not aligned to 2 bytes"):
        _core.silu_mul_bf16(to_dlpack(gate_up), to_dlpack(torch.empty(2, 4, dtype=torch.bfloat16)))


def test_a_non_contiguous_output_is_rejected() -> None:
    out = torch.empty(4, 2, dtype=torch.bfloat16).t()
    with pytest.raises(ValueError, match="out must be contiguous"):
        _core.silu_mul_bf16(to_dlpack(torch.zeros(2, 8, dtype=torch.bfloat16)), to_dlpack(out))


def test_a_written_tensor_may_not_share_memory_with_another_argument() -> None:
    hidden = torch.randn(2, 8).bfloat16()
    with pytest.raises(ValueError, match="hidden and out share memory"):
        _core.add_rms_norm_bf16(
            to_dlpack(hidden), None, to_dlpack(torch.ones(8).bfloat16()), to_dlpack(hidden), 1e-6
        )
    weight = CpuQuantWeight(8, (torch.zeros(1, 32, dtype=torch.int8), torch.rand(1, 1)), 1, 32)
    with pytest.raises(ValueError, match="share memory"):  # out over the weight's own scale
        _core.quant_matmul(weight.rust, to_dlpack(torch.randn(1, 32)), to_dlpack(weight.tensors[1]))


def test_a_wrong_dtype_or_object_is_a_type_error_naming_the_argument() -> None:
    with pytest.raises(TypeError, match="positions must be int64; got int32"):
        cpu_ops.rope_(
            torch.zeros(1, 8),
            1,
            8,
            torch.tensor([0], dtype=torch.int32),
            torch.zeros(2, 8),
            torch.zeros(2, 8),
        )
    with pytest.raises(TypeError, match="gate_up must be a DLPack capsule"):
        _core.silu_mul_bf16([1, 2], to_dlpack(torch.empty(1, 1, dtype=torch.bfloat16)))


def test_a_used_capsule_is_rejected() -> None:
    capsule = to_dlpack(torch.zeros(2, 8, dtype=torch.bfloat16))
    torch.from_dlpack(capsule)
    with pytest.raises(ValueError, match="gate_up is a used or foreign capsule"):
        _core.silu_mul_bf16(capsule, to_dlpack(torch.empty(2, 4, dtype=torch.bfloat16)))


def test_the_decoder_owns_the_tensors_it_was_built_from() -> None:
    # built from capsules of tensors nobody else holds: they must live as long as the decoder
    stack, keep = boundary_fuzz._decoder(2)
    del keep
    gc.collect()
    hidden = torch.randn(1, boundary_fuzz.HIDDEN).bfloat16()
    caches = [
        torch.zeros(2, 2, 2, boundary_fuzz.KV_HEADS, boundary_fuzz.HEAD_DIM, dtype=torch.bfloat16)
        for _ in range(2)
    ]
    table = torch.randn(4, boundary_fuzz.HEAD_DIM).bfloat16()
    step = _step([0, 1], [1], [0], [[0]], [0])
    outs = []
    for _ in range(2):
        out = torch.empty_like(hidden)
        stack.forward(
            to_dlpack(hidden.clone()),
            to_dlpack(out),
            to_dlpack(torch.zeros(1, dtype=torch.int64)),
            [(to_dlpack(table), to_dlpack(table))],
            [to_dlpack(c) for c in caches],
            *map(to_dlpack, step),
            1,
        )
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
