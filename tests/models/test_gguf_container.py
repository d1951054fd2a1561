"""Our GGUF header reader (``model_loader/gguf_container.py``) against the ``gguf``
package's own ``GGUFReader`` on the embedded SmolLM2 file: the same metadata, the same
tensors byte for byte; and a broken file is an error naming the problem."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from fastsched.model_loader import default_model_path
from fastsched.model_loader.gguf_container import GGUFContainer

READER_ONLY_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the header, as fields


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return default_model_path()


def test_metadata_and_tensors_match_gguf_reader(smollm2: Path):
    ours, reference = GGUFContainer(smollm2), GGUFReader(smollm2)
    expected = {k: f.contents() for k, f in reference.fields.items() if k not in READER_ONLY_FIELDS}
    assert ours.metadata == expected
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.data.shape == theirs.data.shape and mine.data.dtype == theirs.data.dtype, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_a_truncated_file_is_an_error(smollm2: Path, tmp_path: Path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2.read_bytes()[: 4 * 1024 * 1024])
    with pytest.raises(ValueError, match="truncated"):
        GGUFContainer(cut)


def test_a_file_that_is_not_gguf_is_an_error(tmp_path: Path):
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFContainer(other)


def test_whole_tensor_dequantization_equals_gguf_quants(smollm2: Path):
    """Our fast paths (Q4_0, Q4_1, Q8_0) and the fallback give gguf's own floats exactly."""
    from gguf.quants import dequantize as reference

    from fastsched.model_loader.gguf_quants import dequantize

    for tensor in GGUFContainer(smollm2).tensors:
        expected = np.asarray(reference(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(
            tensor.shape
        )
        assert np.array_equal(dequantize(tensor), expected), tensor.name
