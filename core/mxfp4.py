"""OCP Microscaling MXFP4: e2m1 elements in blocks of 32 that share one e8m0 scale.

Storage layout (the one gpt-oss checkpoints, vLLM and our kernels use):

* elements are 4-bit e2m1 codes: bit 3 is the sign, bits 0-2 index the magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6};
* two codes per byte along the last axis (K), LOW nibble first: element 2j lives in bits 0-3 and
  element 2j+1 in bits 4-7 of byte j, so packed data is ``[..., K/2]`` uint8;
* each run of 32 consecutive elements along K shares one e8m0 byte ``s``: the block's scale is
  ``2**(s - 127)``, and ``s == 0xFF`` means the whole block is NaN; scales are ``[..., K/32]`` uint8.

numpy + ml_dtypes only (no torch): the runtime and the checkpoint tools use this without torch.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from mxmoe.core.config import MXFP4_BLOCK

__all__ = [
    "FP4_VALUES",
    "E8M0_NAN",
    "E8M0_ONE",
    "pack_fp4",
    "unpack_fp4",
    "e8m0_to_float",
    "quantize",
    "dequantize",
    "random_mxfp4",
    "mxfp8_round_trip",
    "mxint8_round_trip",
    "mxint16_round_trip",
]

#: The 16 e2m1 code values, indexed by code (codes 8..15 are the negatives of 0..7; code 8 is -0).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
FP4_VALUES.setflags(write=False)

#: e8m0 byte that encodes NaN (the OCP spec reserves it; there is no infinity).
E8M0_NAN = 0xFF
#: e8m0 byte of scale 1.0; used for all-zero blocks and padding.
E8M0_ONE = 127

_E2M1_EMAX = 2  # exponent of e2m1's largest normal (6 = 1.5 * 2**2)

# Every byte -> its two float32 element values (low nibble first) stored as one uint64, so unpacking
# is a single np.take (several times faster than fancy indexing into a [256, 2] table).
_BYTE_TO_PAIR = np.ascontiguousarray(
    np.stack([FP4_VALUES[np.arange(256) & 0xF], FP4_VALUES[np.arange(256) >> 4]], axis=-1)
).view(np.uint64).reshape(256)
_BYTE_TO_PAIR.setflags(write=False)

# e8m0 byte -> scale. 2**-127 is a float32 subnormal, still exact.
_E8M0_TO_F32 = np.full(256, np.nan, dtype=np.float32)
_E8M0_TO_F32[:E8M0_NAN] = np.ldexp(np.float32(1.0), np.arange(E8M0_NAN, dtype=np.int32) - 127)
_E8M0_TO_F32.setflags(write=False)

_QUANTIZABLE = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16)}

# Elements processed per step; small enough to stay in cache, large enough to amortise Python.
_CHUNK_ELEMENTS = 1 << 18


def _rounding_thresholds(dtype: np.dtype) -> np.ndarray:
    """Magnitude thresholds t_i such that code(|y|) = number of t_i strictly below |y|.

    Rounding to nearest with ties to even: a tie rounds up only when the upper neighbour has the even
    (zero) mantissa bit. Midpoints whose lower neighbour is even (0.25, 1.25, 2.5, 5) must be strictly
    exceeded; those whose lower neighbour is odd (0.75, 1.75, 3.5) round up when reached, which "strictly
    above the previous float" expresses with a single comparison.
    """
    t = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=dtype)
    odd_below = np.array([False, True, False, True, False, True, False])
    t[odd_below] = np.nextafter(t[odd_below], dtype.type(0))
    return t


_THRESHOLDS = {dt: _rounding_thresholds(dt) for dt in (np.dtype(np.float32), np.dtype(np.float64))}


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """Pack e2m1 codes ``[..., K]`` (uint8 in 0..15, K even) into bytes ``[..., K/2]``, low nibble first."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"codes: expected dtype uint8, got {codes.dtype}")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: expected an even-length last axis, got shape {codes.shape}")
    if codes.size and codes.max() > 0xF:
        raise ValueError(f"codes: expected values in 0..15, got max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Split bytes ``[..., K/2]`` into e2m1 codes ``[..., K]`` (low nibble first)."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed: expected dtype uint8, got {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError(f"packed: expected at least 1 dimension, got shape {packed.shape}")
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    return codes


def e8m0_to_float(scales: np.ndarray) -> np.ndarray:
    """e8m0 bytes -> float32 scales ``2**(s-127)``; 0xFF -> NaN. Exact (2**-127 is a float32 subnormal)."""
    scales = np.asarray(scales)
    if scales.dtype != np.uint8:
        raise ValueError(f"scales: expected dtype uint8, got {scales.dtype}")
    return _E8M0_TO_F32[scales]


def _nonfinite_message(name: str, w: np.ndarray) -> str:
    """Count the NaN/Inf values and locate the first, slice by slice so the mask stays small."""
    count, first = 0, None
    slices = [w] if w.ndim <= 1 else (w[i] for i in range(w.shape[0]))
    for i, part in enumerate(slices):
        bad = ~np.isfinite(part.astype(np.float64) if part.dtype == ml_dtypes.bfloat16 else part)
        n = int(np.count_nonzero(bad))
        if n and first is None:
            idx = tuple(int(j) for j in np.unravel_index(int(np.argmax(bad)), bad.shape))
            first = idx if w.ndim <= 1 else (i,) + idx
        count += n
    return f"{name}: cannot quantize {count} non-finite value(s) (NaN/Inf); first at index {first}"


def _check_blocked_axis(name: str, shape: tuple, axis: int) -> int:
    if not shape:
        raise ValueError(f"{name}: expected at least 1 dimension, got shape {shape}")
    axis = axis % len(shape) if -len(shape) <= axis < len(shape) else None
    if axis is None:
        raise ValueError(f"{name}: axis out of range for shape {shape}")
    return axis


def quantize(w: np.ndarray, axis: int = -1, *, name: str = "w") -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float array to MXFP4 along ``axis`` (K, a multiple of 32).

    Returns ``(packed, scales)``: uint8 with ``axis`` of length K/2 and K/32 respectively.

    Per block of 32: the shared exponent is ``floor(log2(amax)) - 2`` (2 = e2m1's emax, so amax lands in
    [4, 8) and saturates to 6 at worst), stored as ``clamp(e + 127, 0, 254)``; elements ``x / 2**e`` are
    rounded to nearest e2m1 with ties to even, saturating at +-6. The sign bit is copied from x, so
    small negatives become -0 exactly like an ``ml_dtypes.float4_e2m1fn`` cast. All-zero blocks get
    scale byte 127 (scale 1.0) and zero codes. float16/bfloat16/float32 are rounded in float32 (exact
    for them), float64 in float64. NaN/Inf anywhere is rejected: MXFP4 elements cannot carry them.
    """
    w = np.asarray(w)
    if w.dtype not in _QUANTIZABLE:
        raise ValueError(f"{name}: expected a float16/bfloat16/float32/float64 array, got dtype {w.dtype}")
    axis = _check_blocked_axis(name, w.shape, axis)
    k = w.shape[axis]
    if k % MXFP4_BLOCK:
        raise ValueError(f"{name}: axis {axis} has length {k}, expected a multiple of {MXFP4_BLOCK} (shape {w.shape})")

    work = np.dtype(np.float64) if w.dtype == np.float64 else np.dtype(np.float32)
    thresholds = _THRESHOLDS[work]
    moved = np.moveaxis(w, axis, -1)
    lead = moved.shape[:-1]
    rows = moved.reshape(-1, k)  # a view when axis is already last; a copy otherwise
    nblk = k // MXFP4_BLOCK
    packed = np.empty((rows.shape[0], k // 2), dtype=np.uint8)
    scales = np.empty((rows.shape[0], nblk), dtype=np.uint8)

    step = max(1, _CHUNK_ELEMENTS // k)
    for r0 in range(0, rows.shape[0], step):
        x = rows[r0 : r0 + step].astype(work, copy=False).reshape(-1, nblk, MXFP4_BLOCK)
        mag = np.abs(x)
        amax = mag.max(axis=-1)
        if not np.isfinite(amax).all():
            raise ValueError(_nonfinite_message(name, w))
        # frexp: amax = m * 2**p with m in [0.5, 1), so floor(log2(amax)) = p - 1 exactly.
        _, p = np.frexp(amax)
        byte = np.clip(p.astype(np.int32) - 1 - _E2M1_EMAX + 127, 0, 254)
        byte[amax == 0] = E8M0_ONE
        # Multiplying by an exact power of two is exact while the result is normal; subnormal results
        # are far below 0.25 and round to zero either way.
        inv = np.ldexp(work.type(1.0), 127 - byte).astype(work)
        mag *= inv[..., None]
        code = np.zeros(mag.shape, dtype=np.uint8)
        above = np.empty(mag.shape, dtype=bool)
        for t in thresholds:
            np.greater(mag, t, out=above)
            code += above
        code |= np.signbit(x).view(np.uint8) << 3
        code = code.reshape(x.shape[0], k)
        packed[r0 : r0 + step] = code[:, 0::2] | (code[:, 1::2] << 4)
        scales[r0 : r0 + step] = byte
    packed = np.moveaxis(packed.reshape(lead + (k // 2,)), -1, axis)
    scales = np.moveaxis(scales.reshape(lead + (nblk,)), -1, axis)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scales)


def dequantize(packed: np.ndarray, scales: np.ndarray, dtype=np.float32, axis: int = -1) -> np.ndarray:
    """MXFP4 ``(packed, scales)`` -> float array of ``dtype`` with K = 2 * packed's ``axis`` length.

    Exact whenever ``dtype`` can hold the value: products are formed in float32 (float64 when asked
    for), where e2m1 * 2**k is exact except that scales near 2**127 overflow float32 to inf. A NaN
    scale byte (0xFF) makes all 32 elements of its block NaN, as the OCP spec defines.
    """
    packed, scales = np.asarray(packed), np.asarray(scales)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed: expected dtype uint8, got {packed.dtype}")
    if scales.dtype != np.uint8:
        raise ValueError(f"scales: expected dtype uint8, got {scales.dtype}")
    axis = _check_blocked_axis("packed", packed.shape, axis)
    if scales.ndim != packed.ndim:
        raise ValueError(f"scales: expected {packed.ndim} dimensions like packed {packed.shape}, got {scales.shape}")
    half = packed.shape[axis]
    expected = packed.shape[:axis] + (half * 2 // MXFP4_BLOCK,) + packed.shape[axis + 1 :]
    if half % (MXFP4_BLOCK // 2) or scales.shape != expected:
        raise ValueError(
            f"scales: expected shape {expected} for packed {packed.shape} (axis {axis} a multiple of "
            f"{MXFP4_BLOCK // 2} bytes), got {scales.shape}"
        )
    out_dtype = np.dtype(dtype)
    work = np.dtype(np.float64) if out_dtype == np.float64 else np.dtype(np.float32)

    p = np.moveaxis(packed, axis, -1)
    s = np.moveaxis(scales, axis, -1)
    lead = p.shape[:-1]
    p, s = p.reshape(-1, half), s.reshape(-1, half * 2 // MXFP4_BLOCK)
    k, nblk = 2 * half, half * 2 // MXFP4_BLOCK
    out = np.empty((p.shape[0], k), dtype=out_dtype)
    scale_lut = _E8M0_TO_F32.astype(work)
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for r0 in range(0, p.shape[0], step):
        vals = np.take(_BYTE_TO_PAIR, p[r0 : r0 + step]).view(np.float32).astype(work, copy=False)
        vals = vals.reshape(-1, nblk, MXFP4_BLOCK)
        vals *= scale_lut[s[r0 : r0 + step]][..., None]
        out[r0 : r0 + step] = vals.reshape(-1, k)
    return np.ascontiguousarray(np.moveaxis(out.reshape(lead + (k,)), -1, axis))


# Mean of e2m1 value**2 over the 16 codes: the variance of a uniformly random code (its mean is 0).
_CODE_RMS = float(np.sqrt(np.mean(FP4_VALUES.astype(np.float64) ** 2)))


def random_mxfp4(
    rng: np.random.Generator | int | None,
    shape: tuple[int, ...],
    *,
    std: float = 1.0,
    scale_jitter: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 ``(packed, scales)`` for a logical float array of ``shape`` (last axis K, a multiple of 32).

    Draws uniform random codes and scale bytes directly instead of quantizing floats, so gpt-oss-sized
    weights take seconds. Each block's exponent is a base exponent plus a uniform offset in
    ``[-scale_jitter, scale_jitter]`` (to exercise per-block scales); the base is chosen so the dequantized
    values have roughly standard deviation ``std`` (within a factor sqrt(2): exponents are integers).
    """
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    shape = tuple(int(d) for d in shape)
    if not shape or any(d < 0 for d in shape) or shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"shape: expected a last axis that is a multiple of {MXFP4_BLOCK}, got {shape}")
    if not (std > 0 and math.isfinite(std)):
        raise ValueError(f"std: expected a positive finite number, got {std}")
    if scale_jitter < 0:
        raise ValueError(f"scale_jitter: expected >= 0, got {scale_jitter}")
    lead, k = shape[:-1], shape[-1]

    nbytes = math.prod(lead) * (k // 2)
    words = rng.integers(0, np.iinfo(np.uint64).max, size=-(-nbytes // 8), dtype=np.uint64, endpoint=True)
    packed = words.view(np.uint8)[:nbytes].reshape(lead + (k // 2,))

    # With exponent offsets j uniform over the jitter range, E[value**2] = CODE_RMS**2 * 4**base * mean(4**j).
    offsets = np.arange(-scale_jitter, scale_jitter + 1)
    spread = float(np.sqrt(np.mean(4.0 ** offsets)))
    base = int(round(math.log2(std / (_CODE_RMS * spread)))) + 127
    jitter = rng.integers(-scale_jitter, scale_jitter + 1, size=lead + (k // MXFP4_BLOCK,), dtype=np.int16)
    scales = np.clip(jitter + base, 0, 254).astype(np.uint8)
    return packed, scales


#: e4m3's largest finite value and the exponent of its largest power of two (OCP MX: emax_elem)
E4M3_MAX, E4M3_EMAX = 448.0, 8


def mxfp8_round_trip(x: np.ndarray) -> np.ndarray:
    """float32 values of ``x`` quantized to MXFP8 along its last axis (a multiple of 32) and back: per block of 32,
    the e8m0 scale byte ``max(e - 8, 0)`` where ``e`` is the biased float32 exponent of the block's largest
    magnitude (OCP MX: ``2^(floor(log2 amax) - emax_elem)``), each element divided by it, saturated to +-448 and
    rounded to nearest even e4m3. The rocm targets' ``activations="mxfp8"`` form computes exactly this
    (``compiler/passes/lowering/rocm_grouped.py``)."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    byte = np.maximum(((amax.view(np.int32) >> 23) & 0xFF) - E4M3_EMAX, 0)
    inv = ((254 - byte) << 23).view(np.float32)          # 2^(127 - byte), a normal float32 for every byte
    codes = np.clip(blocks * inv, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = e8m0_to_float(byte.astype(np.uint8))
    return (codes * scale).reshape(x.shape)


#: MXINT8 (OCP MX): int8 elements in units of 2^-6 of the block scale; mxmoe saturates them to +-127
MXINT8_MAX, MXINT8_FRAC = 127, 6
#: the clamp of the block exponent floor(log2 amax) (the cpu quantizers': all-zero and tiny blocks get -100)
MXINT8_EMIN, MXINT8_EMAX = -100, 127


def _mx_int_round_trip(x: np.ndarray, frac: int, qmax: int) -> np.ndarray:
    """Per block of 32 along the last axis: ``E = floor(log2 amax)`` (from amax's float32 exponent; clamped to
    [-100, 127]), each element ``q = round(x * 2^(frac - E))`` to nearest even, clipped to +-``qmax``, standing for
    ``q * 2^(E - frac)``; a block holding an inf or NaN is NaN."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    bits = (np.abs(blocks).max(axis=-1, keepdims=True).view(np.int32) >> 23) & 0xFF
    e = np.clip(bits - 127, MXINT8_EMIN, MXINT8_EMAX)
    up = ((frac - e + 127) << 23).astype(np.int32).view(np.float32)   # 2^(frac - E), a normal float32
    down = ((e - frac + 127) << 23).astype(np.int32).view(np.float32)  # 2^(E - frac)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite blocks: NaN below
        q = np.clip(np.rint(blocks * up), -qmax, qmax)
        out = np.where(bits == 0xFF, np.float32(np.nan), q * down)
    return out.astype(np.float32).reshape(x.shape)


def mxint8_round_trip(x: np.ndarray) -> np.ndarray:
    """float32 values of ``x`` quantized to MXINT8 along its last axis (a multiple of 32) and back: per block of 32,
    ``E = floor(log2 amax)`` (from amax's float32 exponent; clamped to [-100, 127]), each element
    ``q = round(x * 2^(6 - E))`` to nearest even, saturated to +-127, standing for ``q * 2^(E - 6)``. A block
    holding an inf or NaN is NaN. The cpu target's ``activations="mxint8"`` form computes exactly this
    (``kernels/cpu/mxint8_rows16.c``)."""
    return _mx_int_round_trip(x, MXINT8_FRAC, MXINT8_MAX)


#: the cpu target's ``activations="mxint16"`` elements: units of 2^-13 of the block scale, |q| <= 2^14 (|x| < 2^(E + 1),
#: so clipping there never changes a value)
MXINT16_MAX, MXINT16_FRAC = 1 << 14, 13


def mxint16_round_trip(x: np.ndarray) -> np.ndarray:
    """float32 values of ``x`` as the cpu target's ``activations="mxint16"`` form reads them: as
    :func:`mxint8_round_trip` with elements ``q = round(x * 2^(13 - E))`` (|q| <= 2^14: 15 bits below the block's
    largest, so bf16 values within 2^-6 of it are exact). The kernel splits each q exactly into two int8 planes
    (``kernels/cpu/mxint8_rows16.c``)."""
    return _mx_int_round_trip(x, MXINT16_FRAC, MXINT16_MAX)


#: the sm_90 w4a8 form reads a weight scale group as zeros when its scale is more than this many binades under its
#: row's largest (``mxmoe.kernels.triton._w4a8_kernels``: the e4m3 values of its fold stay normal up to it)
ROW_FOLD_SPAN = 11


def mxfp8_row_round_trip(x: np.ndarray) -> np.ndarray:
    """:func:`mxfp8_round_trip` of ``x`` with each row's values (along the last axis) re-rounded to nearest even e4m3
    on the row's largest block scale: what the sm_90 w4a8 form's quantizers compute (its fp8 MMAs take one scale
    per row). Values keep their MXFP8 value except where it is under e4m3's normal range at the row's scale."""
    x = np.asarray(x, dtype=np.float32)
    v = mxfp8_round_trip(x)
    amax = np.abs(x.reshape(*x.shape[:-1], x.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)).max(axis=-1)
    top = np.maximum(((amax.view(np.int32) >> 23) & 0xFF) - E4M3_EMAX, 0).max(axis=-1, keepdims=True)
    inv = ((254 - top) << 23).view(np.float32)
    return (v * inv).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * e8m0_to_float(top.astype(np.uint8))


def drop_far_groups(codes: np.ndarray, scales: np.ndarray, span: int = ROW_FOLD_SPAN) -> np.ndarray:
    """A copy of packed MXFP4 ``codes`` [..., N, K/2] with the groups whose scale byte (``scales`` [..., N, K/32]) is
    more than ``span`` under its row's largest set to zero codes: the weights the sm_90 w4a8 form computes with."""
    s = np.asarray(scales).astype(np.int32)
    out = np.array(codes, copy=True).reshape(*s.shape, MXFP4_BLOCK // 2)
    out[s < s.max(axis=-1, keepdims=True) - span] = 0
    return out.reshape(np.shape(codes))
