"""The GGUF container format: header, key/value metadata, tensor directory, and the
tensors' bytes as views of one memory map, whose pages the loader drops from the process's
resident memory once it has copied the weights out (:meth:`GGUFContainer.release_pages`).

``gguf.GGUFReader`` builds a numpy view per metadata element, which takes ~10 s for the
~100k vocabulary strings of a small chat model; this reads the same header with
``struct`` in a fraction of a second, so every process that needs a GGUF file's
tokenizer or config can afford to open it. Quantized tensors are returned as raw bytes
shaped for ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata value types (gguf_type) -> struct format of a scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored unquantized, as numpy dtypes.
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions fastest first)
    data: np.ndarray  # typed for plain types; uint8 rows of blocks for quantized ones


class _Cursor:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.offset, self.path = buffer, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        except struct.error:
            raise ValueError(
                f"{self.path} is truncated: the GGUF header ends at byte {self.offset}"
            ) from None
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("Q")
        if self.offset + size > len(self.buffer):
            raise ValueError(f"{self.path} is truncated: a string at byte {self.offset} runs past the end")
        raw = bytes(self.buffer[self.offset : self.offset + size])
        self.offset += size
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in _SCALARS:  # one numpy read instead of `count` unpacks
                fmt = _SCALARS[item_type]
                items = np.frombuffer(self.buffer, dtype=np.dtype("<" + fmt), count=count, offset=self.offset)
                self.offset += items.nbytes
                return items.tolist()
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type} at byte {self.offset}")


class GGUFContainer:
    """One GGUF file, memory-mapped: ``metadata`` (plain Python values) and ``tensors``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as file:
            self._mmap = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        cursor = _Cursor(memoryview(self._map), path)
        if bytes(self._map[:4]) != MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
        cursor.offset = 4
        version = cursor.unpack("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        num_tensors, num_fields = cursor.unpack("Q"), cursor.unpack("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.unpack("I"))
        directory = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [cursor.unpack("Q") for _ in range(cursor.unpack("I"))]
            directory.append((name, dims, GGMLQuantizationType(cursor.unpack("I")), cursor.unpack("Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.offset // alignment) * alignment
        self.tensors = [
            self._tensor(name, dims, kind, data_start + offset) for name, dims, kind, offset in directory
        ]

    def release_pages(self) -> None:
        """Drops the file's pages from this process's resident set (``MADV_DONTNEED``). Every
        weight is copied out of the map as it loads (repacked for the kernels or converted to
        the model's dtype), so the pages it read would otherwise stay resident for nothing,
        adding the file's size to the engine's RSS. A tensor view read afterwards still
        works: its pages are read back from the file."""
        if hasattr(mmap, "MADV_DONTNEED"):  # Linux and most Unixes
            self._mmap.madvise(mmap.MADV_DONTNEED)

    def _tensor(self, name: str, dims: list[int], kind: GGMLQuantizationType, start: int) -> GGUFTensor:
        shape = tuple(reversed(dims))
        count = math.prod(shape)  # Python's integers: np.prod wraps around past int64
        if kind not in _PLAIN_DTYPES and (not shape or shape[-1] % GGML_QUANT_SIZES[kind][0]):
            raise ValueError(
                f"{self.path}: tensor {name} of shape {shape} is not made of whole {kind.name} blocks"
            )
        if kind in _PLAIN_DTYPES:
            dtype = np.dtype(_PLAIN_DTYPES[kind])
            rows, nbytes = shape, count * dtype.itemsize
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            dtype = np.dtype(np.uint8)
            rows = (*shape[:-1], shape[-1] // block_size * type_size)
            nbytes = count // block_size * type_size
        if start + nbytes > len(self._map) or start < 0:
            raise ValueError(f"{self.path} is truncated: tensor {name} ends past the end of the file")
        data = self._map[start : start + nbytes].view(dtype).reshape(rows)
        return GGUFTensor(name, kind, shape, data)
