"""The byte permutations behind the weight layouts (:mod:`mxmoe.core.layouts`), each with its inverse.

All take and return packed e2m1 values ``[..., N, K/2]`` uint8 (two codes a byte, low nibble = even k) and
keep the shape; tests check every pair as a round trip. numpy only.
"""

from __future__ import annotations

import numpy as np


def blocksplit_swizzle(values: np.ndarray) -> np.ndarray:
    """Row-major packed e2m1 bytes [..., K/2] -> the blocksplit order (see ``layouts.CPU_BLOCKSPLIT``)."""
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


#: output rows interleaved per group of the rows16 layout (one zmm of int32 lanes)
ROWS16 = 16


def _rows16_check(shape: tuple, what: str, block_bytes: int = 16) -> None:
    """``what`` [..., N, K/2] values (``block_bytes`` 16 per 32-value block) or [..., N, K/32] scales (1)."""
    if len(shape) < 2 or shape[-2] % ROWS16 or shape[-1] % block_bytes:
        raise ValueError(f"rows16 needs {what} rows in groups of {ROWS16}" +
                         (" and whole 32-value blocks" if block_bytes > 1 else "") + f", got shape {list(shape)}")


def rows16_swizzle(values: np.ndarray) -> np.ndarray:
    """Row-major packed e2m1 bytes [..., N, K/2] -> the rows16 order (see ``layouts.CPU_ROWS16``): per group of
    16 rows and 32-value block, 4 chunks j of 64 bytes; byte 4i + t of chunk j holds row i's values 4j + t (low
    nibble) and 16 + 4j + t (high nibble) of the block."""
    v = np.asarray(values, dtype=np.uint8)
    _rows16_check(v.shape, "weight")
    *lead, n, kh = v.shape
    nb = kh // 16
    codes = np.stack([v & 0x0F, v >> 4], axis=-1).reshape(*lead, n // ROWS16, ROWS16, nb, 2, 4, 4)  # h j t
    nd = len(lead)
    # [.., G, i, b, h, j, t] -> [.., G, b, j, i, t, h]
    c = codes.transpose(*range(nd), nd, nd + 2, nd + 4, nd + 1, nd + 5, nd + 3)
    return (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8).reshape(v.shape)


def rows16_unswizzle(stored: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rows16_swizzle`."""
    v = np.asarray(stored, dtype=np.uint8)
    _rows16_check(v.shape, "weight")
    *lead, n, kh = v.shape
    nb = kh // 16
    nd = len(lead)
    c = np.stack([v & 0x0F, v >> 4], axis=-1).reshape(*lead, n // ROWS16, nb, 4, ROWS16, 4, 2)  # b j i t h
    codes = c.transpose(*range(nd), nd, nd + 3, nd + 1, nd + 5, nd + 2, nd + 4).reshape(*lead, n, kh, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)


def rows16_scales(scales: np.ndarray) -> np.ndarray:
    """Row-major e8m0 scales [..., N, K/32] -> per group of 16 rows and block, the 16 rows' bytes side by side."""
    s = np.asarray(scales)
    _rows16_check(s.shape, "scale", block_bytes=1)
    *lead, n, nb = s.shape
    return np.ascontiguousarray(np.swapaxes(s.reshape(*lead, n // ROWS16, ROWS16, nb), -1, -2)).reshape(s.shape)


def rows16_unscales(stored: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rows16_scales`."""
    s = np.asarray(stored)
    _rows16_check(s.shape, "scale", block_bytes=1)
    *lead, n, nb = s.shape
    return np.ascontiguousarray(np.swapaxes(s.reshape(*lead, n // ROWS16, nb, ROWS16), -1, -2)).reshape(s.shape)


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
        raise ValueError(f"the Hopper word layout needs values [..., N, K/2] with N a multiple of 16 and K of 32, "
                         f"got {list(v.shape)}")
    return v.shape[:-2], v.shape[-2] // 16, v.shape[-1] // 16


def hopper_swizzle(values: np.ndarray) -> np.ndarray:
    """Checkpoint bytes [..., N, K/2] -> the Hopper word order (same shape).

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
    """Checkpoint bytes [..., N, K/2] -> the tiled Hopper order (same shape)."""
    return _tiles(hopper_swizzle(values), inverse=False)


def hopper_tiled_unswizzle(stored: np.ndarray) -> np.ndarray:
    """Inverse of :func:`hopper_tiled_swizzle`."""
    return hopper_unswizzle(_tiles(stored, inverse=True))
