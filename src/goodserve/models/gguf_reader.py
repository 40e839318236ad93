"""A lean GGUF reader: the metadata as plain Python values and the tensors as views of one memory map.

Why not ``gguf.GGUFReader`` (llama.cpp's own Python package, which we still use for its constants and its
dequantization kernels): its constructor builds a ``ReaderField`` holding numpy views for every element of
every metadata array, about 200,000 small arrays for SmolLM2's 49,152-token vocabulary and 48,900 merges,
which took ~5.8 s of the ~6 s it spent opening the default model; gguf 0.19 has no entry point that skips
them. transformers 5 has a lean reader of its own (``transformers.integrations.gguf.reader``), but it is an
internal module of recent releases and importing it pulls in transformers, which a one-shot ``goodserve
chat`` no longer imports. The format is small (ggml ``docs/gguf.md``): this module reads GGUF v2/v3
little-endian files with :mod:`struct` and one :class:`mmap.mmap` in ~0.1 s, and
``tests/test_gguf_reader.py`` checks it field for field against ``gguf.GGUFReader`` on the default model.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
_VERSIONS = (2, 3)  # v1 counted with 32-bit integers; llama.cpp has not written it since 2023

# GGUFValueType -> struct format of one scalar (8: string and 9: array are read apart).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")

# ggml types whose tensors hold plain values (gguf.GGUFReader maps these with their numpy dtype, every other
# type as the bytes of its blocks, one row of blocks per row of the tensor).
_VALUE_DTYPES = {0: np.float32, 1: np.float16, 16: np.int8, 17: np.int16, 18: np.int32, 27: np.int64,
                 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file (the fields ``gguf.ReaderTensor`` has, minus its raw info parts).

    Attributes:
        name: GGUF tensor name (``blk.0.attn_q.weight``).
        tensor_type: ``gguf.GGMLQuantizationType``.
        shape: Dimensions as the file lists them, fastest-varying first (ggml ``ne`` order).
        n_elements: Number of weights.
        n_bytes: Bytes of the tensor in the file.
        data_offset: Absolute file offset of its data.
        data: Read-only view of the memory map: ``[*reversed(shape)]`` values for float/int types, else
            ``[*reversed(shape[1:]), bytes_per_row]`` uint8 blocks.
    """

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file opened for reading: ``fields`` (metadata) and ``tensors``, data left on disk until used.

    Args:
        path: The ``.gguf`` file.

    Attributes:
        version: GGUF format version.
        fields: Metadata key -> value: ``int``, ``float``, ``bool`` or ``str`` for scalars, a ``list`` of them
            for arrays (``gguf.ReaderField.contents()`` gives the same values).
        tensors: In file order.
        alignment: Data alignment (``general.alignment``, default 32).
        data_offset: File offset where tensor data begins.

    Raises:
        ValueError: if the file is not GGUF, is big-endian, or has a version, value type or tensor type this
            reader does not know.
    """

    def __init__(self, path: str) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        self.version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if self.version not in _VERSIONS:
            what = "big-endian" if self.version & 0xFFFF == 0 else f"version {self.version}"
            raise ValueError(f"{path}: GGUF {what} files are not supported (little-endian v2/v3 only)")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = struct.unpack_from(f"<{self._u32()}Q", buf, self._pos)
            self._pos += 8 * len(dims)
            ggml_type, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            infos.append((name, dims, ggml_type, offset))
        self.alignment = int(self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"{path}: alignment {self.alignment} is not a power of two")
        self.data_offset = -(-self._pos // self.alignment) * self.alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, raw_type, offset in infos:
            try:
                ggml_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"{path}: tensor {name} has unknown ggml type {raw_type}") from None
            n_elements = int(np.prod(dims, dtype=np.int64))
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elements * type_size // block
            start = self.data_offset + offset
            rows = tuple(reversed(dims))
            if raw_type in _VALUE_DTYPES:
                data = np.frombuffer(buf, _VALUE_DTYPES[raw_type], n_elements, start).reshape(rows)
            else:
                data = np.frombuffer(buf, np.uint8, n_bytes, start).reshape(*rows[:-1], rows[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, ggml_type, dims, n_elements, n_bytes, start, data))

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key``, or ``default`` when the file lacks it."""
        return self.fields.get(key, default)

    def _u32(self) -> int:
        (value,) = struct.unpack_from("<I", self._map, self._pos)
        self._pos += 4
        return value

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._map[start:start + n].decode("utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALAR:
            fmt = _SCALAR[value_type]
            (value,) = struct.unpack_from(fmt, self._map, self._pos)
            self._pos += struct.calcsize(fmt)
            return value
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        item_type = self._u32()
        (count,) = struct.unpack_from("<Q", self._map, self._pos)
        self._pos += 8
        if item_type in _SCALAR:  # numbers: one numpy read, not one struct call each
            dtype = np.dtype(_SCALAR[item_type].replace("?", "b1"))
            values = np.frombuffer(self._map, dtype, count, self._pos).tolist()
            self._pos += count * dtype.itemsize
            return values
        if item_type == _STRING:  # a vocabulary or merge table: the loop kept tight
            buf, pos, values, length = self._map, self._pos, [], _U64.unpack_from
            for _ in range(count):
                (n,) = length(buf, pos)
                values.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
                pos += 8 + n
            self._pos = pos
            return values
        return [self._value(item_type) for _ in range(count)]
