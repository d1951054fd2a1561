"""What loading a GGUF model leaves resident (bench/RESULTS.md, "CPU decode: engine memory"):
the file's pages are released once the weights are copied out of its memory map, the
weights kept quantized have no dense copy beside them, and building the model does not
import ``torch._dynamo`` (with inductor, sympy and Triton: ~150 MiB the engine never uses)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fastsched.kernels import quant_matmul_cpu
from fastsched.model_loader import default_model_path, open_gguf
from fastsched.model_loader.gguf_container import GGUFContainer
from fastsched.model_loader.weights import load_model
from fastsched.models.quant_linear import QuantEmbedding, QuantLinear

SMAPS = Path("/proc/self/smaps")
pytestmark = pytest.mark.skipif(not SMAPS.exists(), reason="needs Linux's /proc/self/smaps")


def resident_kib(path: Path) -> int:
    """Resident KiB of every mapping of ``path`` in this process."""
    total, inside = 0, False
    for line in SMAPS.read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) > 5 and Path(fields[5]) == path
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_release_pages_drops_the_file_from_the_resident_set():
    path = default_model_path().resolve()
    container = GGUFContainer(path)
    checksum = sum(int(t.data.view(np.uint8).sum()) for t in container.tensors)  # every page read
    file_kib = path.stat().st_size // 1024
    assert resident_kib(path) > file_kib // 2
    container.release_pages()
    assert resident_kib(path) < file_kib // 20
    # The views still read the file's bytes (their pages come back from the page cache).
    assert sum(int(t.data.view(np.uint8).sum()) for t in container.tensors) == checksum


def test_iter_weights_yields_copies_and_releases_the_file():
    path = default_model_path().resolve()
    gguf = open_gguf(path)
    file_map = gguf.container._map
    for name, weight in gguf.iter_weights(gguf.config(), keep_quantized=True):
        parts = [weight] if isinstance(weight, np.ndarray) else [p for p in weight if p is not None]
        assert not any(np.may_share_memory(part, file_map) for part in parts), name
    assert resident_kib(path) < path.stat().st_size // 1024 // 20


@pytest.mark.skipif(not quant_matmul_cpu.AVAILABLE, reason="the Rust CPU kernels are not built")
def test_gguf_model_holds_no_dense_copy_of_its_quantized_weights():
    model = load_model(None, dtype=torch.bfloat16, quantization="gguf")
    quantized = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert len(quantized) == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down; the tied embedding
    assert all(not hasattr(m.weight_packed, "dense") for m in quantized)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    assert dense < 2**20  # the norms only: no [N, K] matrix left dense
    packed = sum(m.weight_packed.nbytes() for m in quantized)
    params = sum(m.weight_packed.in_features * m.weight_packed.out_features for m in quantized)
    assert packed < params  # under a byte a weight: nothing kept at 16 or 32 bits


def test_building_the_model_does_not_import_dynamo():
    script = textwrap.dedent("""
        import sys
        import torch
        from fastsched.model_loader.weights import load_model
        load_model(None, dtype=torch.bfloat16, quantization="gguf")
        print(sorted(m for m in ("torch._dynamo", "triton", "sympy") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
