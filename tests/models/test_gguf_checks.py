"""A GGUF's metadata is bounded against its tensor table before the model is sized from it
(``model_loader/gguf_checks.py``, issue 37): the embedded SmolLM2 file with one metadata
value rewritten in place is refused with the field named, at once, never built."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from fastsched.model_loader import default_model_path, load_model_config
from fastsched.model_loader.gguf import GGUFFile

_UINT32 = 4  # GGUF's value type of SmolLM2's sizes


@pytest.fixture(scope="module")
def smollm2_bytes() -> bytes:
    return default_model_path().read_bytes()


def patched(data: bytes, key: str, value: int, out: Path) -> Path:
    """``data`` with the uint32 value of metadata ``key`` replaced by ``value``."""
    encoded = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(encoded) + len(encoded)
    assert struct.unpack_from("<I", data, at)[0] == _UINT32
    out.write_bytes(data[: at + 4] + struct.pack("<I", value) + data[at + 8 :])
    return out


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("llama.block_count", 100000, r"block_count = 100000, but the file's tensors are of 30 layers"),
        ("llama.block_count", 29, r"block_count = 29, but the file's tensors are of 30 layers"),
        ("llama.attention.head_count", 0, r"head_count = 0 must be an integer in \[1, "),
        ("llama.attention.head_count_kv", 2, r"head_count_kv = 2 does not divide .*head_count = 9"),
        ("llama.embedding_length", 2**31, r"embedding_length = 2147483648 must be an integer"),
        (
            "llama.feed_forward_length",
            1537,
            r"blk.0.ffn_gate.weight has shape \(1536, 576\).*implies \(1537, 576\)",
        ),
    ],
)
def test_metadata_the_tensors_contradict_is_refused_before_the_model_is_built(
    smollm2_bytes: bytes, tmp_path: Path, key: str, value: int, message: str
) -> None:
    path = patched(smollm2_bytes, key, value, tmp_path / "model.gguf")
    with pytest.raises(ValueError, match=message):
        GGUFFile(path).config()
    with pytest.raises(ValueError, match=message):
        load_model_config(path)  # what LLM(path) and the engine read first


def test_the_real_files_pass(smollm2_bytes: bytes) -> None:
    assert load_model_config(default_model_path()).num_layers == 30
