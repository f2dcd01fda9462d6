"""How a weight array is stored for a target: padding plus a named layout. numpy only (no torch, no MLIR).

The compiler's passes decide each weight global's stored form and record it as attributes; the
compiler turns those into a :class:`StoredForm` per parameter, applies it when it writes the weights,
and the artifact keeps the forms in its manifest, so the runtime can apply the very same transform to
raw checkpoint weights at deploy time without the compiler.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

#: The convention's layout: values [E, N, K/2] (two e2m1 per byte, low nibble first), scales [E, N, K/32].
ROW_MAJOR = "mxfp4-rowmajor"

#: Triton (cuda) targets: the checkpoint's own K-contiguous order, stored unchanged.
TRITON_KMAJOR = "triton-mxfp4-kmajor"

Transform = Callable[[str, np.ndarray], np.ndarray]  # (role, array) -> array

#: layout name -> (to the stored array, back to the row-major array); role is "values", "scales" or "bias".
_LAYOUTS: dict[str, tuple[Transform, Transform]] = {}


#: CPU layout: within each 32-value block (16 bytes of a row), byte b holds value b in its low nibble and
#: value b + 16 in its high nibble, so each nibble plane of 8 consecutive bytes lines up with 8 consecutive
#: activations (the CPU lowering's SIMD lanes). Scales and biases stay row-major. Same shape and size as
#: row-major, so the weight globals keep their types.
CPU_BLOCKSPLIT = "cpu-mxfp4-blocksplit"


def blocksplit_swizzle(values: np.ndarray) -> np.ndarray:
    """Row-major packed e2m1 bytes [..., K/2] -> the blocksplit order (see :data:`CPU_BLOCKSPLIT`)."""
    v = np.asarray(values, dtype=np.uint8)
    if v.shape[-1] % 16:
        raise ValueError(f"blocksplit needs K/2 to be a multiple of 16 bytes, got {v.shape[-1]}")
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // 16, 16)
    nib = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # value order
    return (nib[..., :16] | (nib[..., 16:] << 4)).astype(np.uint8).reshape(v.shape)


def blocksplit_unswizzle(stored: np.ndarray) -> np.ndarray:
    """Inverse of :func:`blocksplit_swizzle`."""
    v = np.asarray(stored, dtype=np.uint8)
    if v.shape[-1] % 16:
        raise ValueError(f"blocksplit needs K/2 to be a multiple of 16 bytes, got {v.shape[-1]}")
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // 16, 16)
    nib = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1)  # value order 0..31
    pairs = nib.reshape(*blocks.shape[:-1], 16, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8).reshape(v.shape)


#: Hopper (sm_90) layout of the Triton path: each 32-bit word holds the 8 e2m1 values one thread of a
#: warpgroup MMA needs from a 32-value block, from two rows 8 apart, with the bits of every value already
#: at their bf16 positions, so the kernel turns a word into four bf16 pairs with 9 integer ops and one
#: multiply per pair (``runtime/triton_kernels/_gemm_kernels.py``, docs/nvidia.md). Scales and biases stay
#: row-major; the array keeps its [E, N, K/2] shape (N a multiple of 16, K of 32).
TRITON_HOPPER = "triton-mxfp4-hopper"

#: Bits of one bf16 pair (low half: an even k, high half: k + 1) for codes whose value is v * 2^-126:
#: sign at bit 15, exponent at bits 8-7, mantissa at bit 6 (the subnormal code 0.5 included).
HOPPER_PAIR_MASK = 0x81C081C0
#: Largest e8m0 scale byte for which the kernels' one-multiply decode is exact (2^126 * 2^(s-127) is then a
#: finite bf16); a layer with a larger one (values past +-12) or a NaN scale uses the two-multiply form.
HOPPER_MAX_FAST_SCALE = 128
#: How the kernel takes pair j out of a stored word w: OR over (mask, r) of rotl(w, r) & mask.
HOPPER_PAIR_BITS = (((HOPPER_PAIR_MASK, 0),), ((HOPPER_PAIR_MASK, 6),), ((HOPPER_PAIR_MASK, 12),),
                    ((0x00400040, 2), (0x81808180, 10)))


def _hopper_pair_bits(byte: int) -> int:
    """bf16-pair bits (v * 2^-126 each) of a checkpoint byte (low nibble = even k)."""
    def half(code):
        return ((code & 8) << 12) | ((code & 7) << 6)
    return half(byte & 15) | (half(byte >> 4) << 16)


def _hopper_tables() -> np.ndarray:
    """[4, 256] uint32: the word bits pair j contributes for each checkpoint byte."""
    tables = np.zeros((4, 256), dtype=np.uint32)
    for j, groups in enumerate(HOPPER_PAIR_BITS):
        for b in range(256):
            p, word = _hopper_pair_bits(b), 0
            for mask, r in groups:
                for bit in range(32):
                    if mask >> bit & 1 and p >> bit & 1:
                        word |= 1 << ((bit - r) % 32)
            tables[j, b] = word
    return tables


_HOPPER_TABLES = _hopper_tables()
#: pair j of a word holds (row r + 8 * ROW8[j], k + 16 * K16[j]) of its 32-value block
_HOPPER_ROW8, _HOPPER_K16 = (0, 1, 0, 1), (0, 0, 1, 1)


def _hopper_split(v: np.ndarray) -> tuple[tuple[int, ...], int, int]:
    if v.ndim < 2 or v.shape[-2] % 16 or v.shape[-1] % 16:
        raise ValueError(f"{TRITON_HOPPER} needs values [..., N, K/2] with N a multiple of 16 and K of 32, "
                         f"got {list(v.shape)}")
    return v.shape[:-2], v.shape[-2] // 16, v.shape[-1] // 16


def hopper_swizzle(values: np.ndarray) -> np.ndarray:
    """Checkpoint bytes [..., N, K/2] -> :data:`TRITON_HOPPER` order (same shape).

    Checkpoint byte (row 16g + 8rb + i, byte 16kb + 8t + 4jl + q) holds the pair (k, k+1) with
    k = 32kb + 16t + 8jl + 2q; it becomes pair j = rb + 2t of the word at stored row 16g + 8jl + i,
    bytes 16kb + 4q .. +3 (little-endian). One [N, K/2] matrix at a time (bounded memory)."""
    v = np.asarray(values, dtype=np.uint8)
    lead, g, kb = _hopper_split(v)
    flat = v.reshape(-1, *v.shape[-2:])
    out = np.empty((flat.shape[0], g, 2, 8, kb, 4), dtype="<u4")  # [g, jl, i, kb, q]
    for e, matrix in enumerate(flat):
        src = matrix.reshape(g, 2, 8, kb, 2, 2, 4)  # [g, rb, i, kb, t, jl, q]
        word = np.zeros((g, 8, kb, 2, 4), dtype=np.uint32)  # [g, i, kb, jl, q]
        for j in range(4):
            word |= _HOPPER_TABLES[j][src[:, _HOPPER_ROW8[j], :, :, _HOPPER_K16[j]]]
        out[e] = word.transpose(0, 3, 1, 2, 4)
    return out.view(np.uint8).reshape(v.shape)


def hopper_unswizzle(stored: np.ndarray) -> np.ndarray:
    """Inverse of :func:`hopper_swizzle`."""
    v = np.asarray(stored, dtype=np.uint8)
    lead, g, kb = _hopper_split(v)
    flat = np.ascontiguousarray(v).reshape(-1, *v.shape[-2:])
    out = np.empty((flat.shape[0], g, 2, 8, kb, 2, 2, 4), dtype=np.uint8)  # [g, rb, i, kb, t, jl, q]
    for e, matrix in enumerate(flat):
        word = matrix.view("<u4").reshape(g, 2, 8, kb, 4).transpose(0, 2, 3, 1, 4).astype(np.uint32)  # [g, i, kb, jl, q]
        for j, groups in enumerate(HOPPER_PAIR_BITS):
            p = np.zeros_like(word)
            for mask, r in groups:
                rotated = (word << np.uint32(r)) | (word >> np.uint32(32 - r)) if r else word
                p |= rotated & np.uint32(mask)
            lo, hi = p & np.uint32(0xFFFF), p >> np.uint32(16)
            codes = [((h >> np.uint32(12)) & np.uint32(8)) | ((h >> np.uint32(6)) & np.uint32(7)) for h in (lo, hi)]
            out[e, :, _HOPPER_ROW8[j], :, :, _HOPPER_K16[j]] = codes[0] | (codes[1] << np.uint32(4))
    return out.reshape(v.shape)


#: The sm_90 layout of the Triton path: :data:`TRITON_HOPPER` words, then each expert's matrix stored in
#: 64-row groups, each group chunk by chunk along K (128 bytes of every row of the group, then the next
#: 128), so that a K step of a 64-row weight tile is one contiguous run of bytes (8 KB at BLOCK_K = 256)
#: instead of 64 row pieces K/2 bytes apart (H100, gpt-oss layers at 8-64 tokens: 7-10% faster,
#: docs/nvidia.md). Same [E, N, K/2] shape and bytes; see :func:`hopper_tile_offsets`.
TRITON_HOPPER_TILED = "triton-mxfp4-hopper-tiled"
#: Rows of a group and bytes of a chunk's row in the tiled layout (a kernel's K step must not straddle
#: chunks: BLOCK_K <= 256). 32-byte chunks (each step's 8 KB still contiguous) measured 2% instead of 7-10%.
HOPPER_TILE_ROWS = 64
HOPPER_TILE_BYTES = 128


def hopper_tile_offsets(n: int, kb: int) -> np.ndarray:
    """[n, kb] stored offset of byte ``b`` of row ``r`` of one expert's [N, K/2] matrix in the tiled layout.

    Rows come in groups of HOPPER_TILE_ROWS (the last may be shorter: ``rg`` rows); a group keeps its place
    (rows ``g0 .. g0 + rg`` occupy the same ``rg * kb`` bytes as before) and is stored chunk by chunk along K:
    chunk ``j`` (bytes ``128j .. 128j + w``, ``w = min(128, kb - 128j)``) is ``rg`` rows of ``w`` bytes,
    contiguous. The kernels compute the same formula (``_gemm_kernels._hopper_tile``)."""
    r = np.arange(n, dtype=np.int64)[:, None]
    b = np.arange(kb, dtype=np.int64)[None, :]
    g0 = r // HOPPER_TILE_ROWS * HOPPER_TILE_ROWS
    rg = np.minimum(HOPPER_TILE_ROWS, n - g0)
    j = b // HOPPER_TILE_BYTES
    w = np.minimum(HOPPER_TILE_BYTES, kb - HOPPER_TILE_BYTES * j)
    return g0 * kb + rg * (HOPPER_TILE_BYTES * j) + (r - g0) * w + (b - HOPPER_TILE_BYTES * j)


def _tiles(v: np.ndarray, inverse: bool) -> np.ndarray:
    v = np.ascontiguousarray(v, dtype=np.uint8)
    n, kb = v.shape[-2:]
    offs = hopper_tile_offsets(n, kb).reshape(-1)
    flat = v.reshape(-1, n * kb)
    if inverse:
        return flat[:, offs].reshape(v.shape)
    out = np.empty_like(flat)
    out[:, offs] = flat
    return out.reshape(v.shape)


def hopper_tiled_swizzle(values: np.ndarray) -> np.ndarray:
    """Checkpoint bytes [..., N, K/2] -> :data:`TRITON_HOPPER_TILED` order (same shape)."""
    return _tiles(hopper_swizzle(values), inverse=False)


def hopper_tiled_unswizzle(stored: np.ndarray) -> np.ndarray:
    """Inverse of :func:`hopper_tiled_swizzle`."""
    return hopper_unswizzle(_tiles(stored, inverse=True))


def register_layout(name: str, transform: Transform, inverse: Transform) -> None:
    """Make ``name`` a known layout: ``transform(role, row_major)`` gives the stored array and
    ``inverse(role, stored)`` gives it back (reference checks read weights out of artifacts)."""
    _LAYOUTS[name] = (transform, inverse)


def known_layouts() -> list[str]:
    return sorted(_LAYOUTS)


def _layout(name: str, what: str) -> tuple[Transform, Transform]:
    if name not in _LAYOUTS:
        raise ValueError(f"weight '{what}': unknown layout '{name}' (known: {', '.join(known_layouts())})")
    return _LAYOUTS[name]


@dataclass(frozen=True)
class StoredForm:
    """What turns a logical weight array into the array a compiled module reads."""

    shape: tuple[int, ...]                # logical shape (before padding)
    padded_shape: tuple[int, ...]         # shape after padding (== shape when unpadded)
    pad_value: int = 0                    # fill for padded elements (as the stored integer/float value)
    pad_halves: bool = False              # axis 1 holds two halves (gate | up): pad each half
    layout: str | None = None             # named layout applied after padding; None = as is
    role: str | None = None               # "values", "scales" or "bias" for weights with a layout

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StoredForm":
        d = dict(d)
        d["shape"], d["padded_shape"] = tuple(d["shape"]), tuple(d["padded_shape"])
        return cls(**d)

    def apply(self, name: str, array: np.ndarray) -> np.ndarray:
        """The stored array for ``array`` (raises ValueError naming ``name`` on a shape mismatch)."""
        if tuple(array.shape) != tuple(self.shape):
            raise ValueError(f"weight '{name}': expected shape {list(self.shape)}, got {list(array.shape)}")
        out = pad_array(array, self.padded_shape, self.pad_value, self.pad_halves)
        if self.layout is not None:
            out = _layout(self.layout, name)[0](self.role or "", out)
        return np.ascontiguousarray(out)

    def invert(self, name: str, stored: np.ndarray) -> np.ndarray:
        """The logical array ``stored`` was made from: layout undone, padding sliced off."""
        if tuple(stored.shape) != tuple(self.padded_shape):
            raise ValueError(f"weight '{name}': expected stored shape {list(self.padded_shape)}, got {list(stored.shape)}")
        a = stored if self.layout is None else _layout(self.layout, name)[1](self.role or "", stored)
        if self.pad_halves and self.padded_shape[1] != self.shape[1]:
            h, hp = self.shape[1] // 2, self.padded_shape[1] // 2
            a = np.concatenate([a[:, :h], a[:, hp:hp + h]], axis=1)
        return a[tuple(slice(0, d) for d in self.shape)]


def pad_array(a: np.ndarray, shape: tuple[int, ...], fill, halves: bool = False) -> np.ndarray:
    """Pad ``a`` at the end of each axis up to ``shape`` with ``fill``.

    With ``halves`` the second axis is two equal halves (a concatenated gate|up projection), and each
    half is padded on its own so that gate row i and up row i stay paired.
    """
    shape = tuple(int(s) for s in shape)
    if tuple(a.shape) == shape:
        return a
    if len(shape) != a.ndim or any(s < d for s, d in zip(shape, a.shape)):
        raise ValueError(f"cannot pad shape {list(a.shape)} to {list(shape)}")
    if halves:
        if a.shape[1] % 2 or shape[1] % 2:
            raise ValueError(f"pad_halves needs an even axis 1, got {a.shape[1]} -> {shape[1]}")
        h = a.shape[1] // 2
        half_shape = (shape[0], shape[1] // 2) + shape[2:]
        return np.concatenate([pad_array(a[:, :h], half_shape, fill), pad_array(a[:, h:], half_shape, fill)], axis=1)
    out = np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, d) for d in a.shape)] = a
    return out


def _values_only(name: str, swizzle, unswizzle) -> tuple[Transform, Transform]:
    """(transform, inverse) of a layout that re-arranges the packed values and leaves scales and biases as
    they are."""
    def transform(role: str, a: np.ndarray) -> np.ndarray:
        if role == "values":
            return swizzle(a).view(a.dtype)
        if role in ("scales", "bias"):
            return a
        raise ValueError(f"layout {name}: unknown weight role {role!r}")

    def inverse(role: str, a: np.ndarray) -> np.ndarray:
        return unswizzle(a).view(a.dtype) if role == "values" else a

    return transform, inverse


def _identity(role: str, a: np.ndarray) -> np.ndarray:
    return a


register_layout(ROW_MAJOR, _identity, _identity)
register_layout(TRITON_KMAJOR, _identity, _identity)
register_layout(CPU_BLOCKSPLIT, *_values_only(CPU_BLOCKSPLIT, blocksplit_swizzle, blocksplit_unswizzle))
register_layout(TRITON_HOPPER, *_values_only(TRITON_HOPPER, hopper_swizzle, hopper_unswizzle))
register_layout(TRITON_HOPPER_TILED, *_values_only(TRITON_HOPPER_TILED, hopper_tiled_swizzle, hopper_tiled_unswizzle))
