"""The safetensors format, read and written with numpy (bfloat16 included), for checkpoints and artifacts.

safetensors' own numpy API cannot return bfloat16 (gpt-oss keeps routers and biases in bf16), so mxmoe carries
this small reader/writer: 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}``, then the raw little-endian data, offsets relative to the
end of the header. Checkpoint files and the weight sections of Triton artifacts both use it. Reads view the
bytes where they lie (a memory-mapped file, an artifact section): nothing is copied. Written tensors follow each
other without holes (the format requires it), largest item size first, so each starts aligned to its dtype.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path
from typing import BinaryIO, Mapping

import ml_dtypes
import numpy as np

from mxmoe.core.files import write_atomically

__all__ = ["SafetensorsView", "SafetensorsFile", "read_safetensors", "write_safetensors", "write_tensors"]

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),   # DeepSeek-V3's block-scaled FP8 checkpoints
}
_DTYPE_NAMES = {dt.newbyteorder("="): name for name, dt in DTYPES.items()}

# The format caps the header at 100 MB; anything larger is a corrupt length field.
_MAX_HEADER = 100_000_000


class SafetensorsView:
    """The tensors of safetensors bytes (``buffer``: bytes, a memoryview or an mmap), header checked at open."""

    def __init__(self, buffer, label: str = "safetensors"):
        self.label = label
        self._buffer = buffer
        head = bytes(buffer[:8])
        self._parse(head, len(buffer), lambda n: bytes(buffer[8:8 + n]))

    def _parse(self, head: bytes, size: int, read_header) -> None:
        if len(head) < 8:
            self._fail(f"truncated: {size} bytes, too short for the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER:
            self._fail(f"not a safetensors file (its first 8 bytes {bytes(head)!r} are not a header length)")
        if 8 + n > size:
            self._fail(f"truncated: header claims {n} bytes but only {size - 8} follow the length")
        try:
            header = json.loads(read_header(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            self._fail(f"corrupt header: not UTF-8 JSON ({exc})")
        if not isinstance(header, dict):
            self._fail(f"corrupt header: expected a JSON object, got {type(header).__name__}")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            self._fail("corrupt header: __metadata__ is not an object")
        self._data_start = 8 + n
        self._data_len = size - self._data_start
        self._entries = {name: self._check_entry(name, info) for name, info in header.items()}

    def _fail(self, what: str):
        raise ValueError(f"{self.label}: {what}")

    def _check_entry(self, name: str, info) -> tuple[str, tuple[int, ...], int, int]:
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = isinstance(dtype, str) and all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            self._fail(f"corrupt header entry for tensor {name!r}: {info!r}")
        if not begin <= end:
            self._fail(f"corrupt header: tensor {name!r} has data_offsets [{begin}, {end}]")
        if end > self._data_len:
            self._fail(f"truncated: tensor {name!r} ends at data byte {end} but the file holds {self._data_len} "
                       "data bytes")
        if dtype in DTYPES and end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
            self._fail(f"corrupt header: tensor {name!r} {dtype}{list(shape)} needs "
                       f"{math.prod(shape) * DTYPES[dtype].itemsize} bytes, data_offsets span {end - begin}")
        return dtype, shape, begin, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _data(self):
        return self._buffer

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only array viewing the buffer (bf16 as ml_dtypes.bfloat16)."""
        if name not in self._entries:
            self._fail(f"no tensor named {name!r}")
        dtype, shape, begin, end = self._entries[name]
        if dtype not in DTYPES:
            self._fail(f"tensor {name!r} has unsupported dtype {dtype} (supported: {', '.join(DTYPES)})")
        if begin == end:
            return np.zeros(shape, dtype=DTYPES[dtype])
        a = np.frombuffer(self._data(), dtype=DTYPES[dtype], count=math.prod(shape), offset=self._data_start + begin)
        return a.reshape(shape)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: self.get(name) for name in self._entries}


class SafetensorsFile(SafetensorsView):
    """One safetensors file: the header read and checked at open, the file memory-mapped on first access."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.label = str(self.path)
        self._mmap: mmap.mmap | None = None
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            self._parse(head, size, f.read)

    def _data(self):
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mmap


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, memory-mapped (read-only)."""
    return SafetensorsFile(path).arrays()


def _checked(tensors: Mapping[str, np.ndarray], metadata) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for name, a in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor name: expected a str other than '__metadata__', got {name!r}")
        a = np.asarray(a, order="C")  # (ascontiguousarray would turn 0-d into 1-d)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if a.dtype.newbyteorder("=") not in _DTYPE_NAMES:
            raise ValueError(f"{name}: unsupported dtype {a.dtype} for safetensors (supported: {', '.join(DTYPES)})")
        arrays[name] = a
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"metadata: expected dict[str, str], got {metadata!r}")
    return arrays


def write_tensors(f: BinaryIO, tensors: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` in the safetensors format to the binary file object ``f`` (streamed, tensor by tensor)."""
    arrays = _checked(tensors, metadata)
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        a = arrays[name]
        header[name] = {"dtype": _DTYPE_NAMES[a.dtype.newbyteorder("=")], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for name in order:
        if arrays[name].nbytes:
            f.write(arrays[name].reshape(-1).view(np.uint8).data)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as a safetensors file readable by safetensors.torch; written next to ``path`` and renamed
    into place (``mxmoe.core.files.write_atomically``)."""
    with write_atomically(path) as f:
        write_tensors(f, tensors, metadata)
