"""Exact MXFP4 decodes as lines of arith ops for linalg.generic bodies (all results f32, no rounding).

e2m1 code ``[s e1 e0 m]``: value ``(-1)^s * 2^(e-1) * (1 + m/2)`` for ``e > 0`` and ``(-1)^s * m/2`` for ``e == 0``.
e8m0 scale byte ``b``: ``2^(b-127)``; ``b == 0`` is ``2^-127`` (an f32 subnormal), ``b == 255`` is NaN.
"""

from __future__ import annotations


def code_value_lines(q: str, out: str, p: str = "dv") -> list[str]:
    """f32 value of the e2m1 code in the low 4 bits of the i32 ``q`` (higher bits of ``q`` are ignored).

    Branch-free: ``g = bits(0x3F000000 + (mag << 22))`` is ``2^(e-1) * (1 + m/2)``, right for ``e > 0``;
    for ``e == 0`` it is 0.5 or 0.75, and ``2g - 1`` gives the subnormals 0 and 0.5. ``min(g, 2g - 1)``
    picks the right one in both cases (for ``e > 0``, ``g >= 1`` so ``2g - 1 >= g``); then the sign bit
    is xor-ed in. Nine vector ops, all exact.
    """
    return [
        f"%{p}k22 = arith.constant 22 : i32", f"%{p}k28 = arith.constant 28 : i32",
        f"%{p}kmag = arith.constant 29360128 : i32", f"%{p}khalf = arith.constant 1056964608 : i32",
        f"%{p}ksgn = arith.constant -2147483648 : i32",
        f"%{p}k2 = arith.constant 2.0 : f32", f"%{p}km1 = arith.constant -1.0 : f32",
        f"%{p}a = arith.shli {q}, %{p}k22 : i32", f"%{p}b = arith.andi %{p}a, %{p}kmag : i32",
        f"%{p}c = arith.addi %{p}b, %{p}khalf : i32", f"%{p}g = arith.bitcast %{p}c : i32 to f32",
        f"%{p}g2 = math.fma %{p}g, %{p}k2, %{p}km1 : f32", f"%{p}m = arith.minimumf %{p}g, %{p}g2 : f32",
        f"%{p}sa = arith.shli {q}, %{p}k28 : i32", f"%{p}sb = arith.andi %{p}sa, %{p}ksgn : i32",
        f"%{p}mi = arith.bitcast %{p}m : f32 to i32", f"%{p}vi = arith.xori %{p}mi, %{p}sb : i32",
        f"{out} = arith.bitcast %{p}vi : i32 to f32",
    ]


def signmag_nibble_value_lines(byte_i8: str, half_index: str, out: str, p: str = "sm") -> list[str]:
    """f32 value of nibble ``half_index`` (an index value, 0 = low) of the i8 ``byte_i8``: the same exact
    value as :func:`nibble_lines` + :func:`code_value_lines`, in fewer vector ops.

    ``a = byte << (28 - 4h)`` puts the nibble's sign bit at bit 31 (and shifts the other nibble out or
    below bit 28); ``(a >> 6) & 0x01C00000`` is the 3-bit magnitude at bits 22-24, decoded as in
    :func:`code_value_lines` (``g = bits(0x3F000000 + ...)``, ``min(g, 2g - 1)`` for the subnormals, here a
    compare + select that lowers to one ``vminps``: neither operand is ever NaN), and ``a & 0x80000000``
    is xor-ed in as the sign.
    """
    return [
        f"%{p}q = arith.extui {byte_i8} : i8 to i32", f"%{p}h = arith.index_cast {half_index} : index to i32",
        f"%{p}k4 = arith.constant 4 : i32", f"%{p}k28 = arith.constant 28 : i32", f"%{p}k6 = arith.constant 6 : i32",
        f"%{p}kmag = arith.constant 29360128 : i32", f"%{p}khalf = arith.constant 1056964608 : i32",
        f"%{p}ksgn = arith.constant -2147483648 : i32",
        f"%{p}k2 = arith.constant 2.0 : f32", f"%{p}km1 = arith.constant -1.0 : f32",
        f"%{p}h4 = arith.muli %{p}h, %{p}k4 : i32", f"%{p}sh = arith.subi %{p}k28, %{p}h4 : i32",
        f"%{p}a = arith.shli %{p}q, %{p}sh : i32", f"%{p}sg = arith.andi %{p}a, %{p}ksgn : i32",
        f"%{p}b0 = arith.shrui %{p}a, %{p}k6 : i32", f"%{p}b = arith.andi %{p}b0, %{p}kmag : i32",
        f"%{p}c = arith.addi %{p}b, %{p}khalf : i32", f"%{p}g = arith.bitcast %{p}c : i32 to f32",
        f"%{p}g2 = math.fma %{p}g, %{p}k2, %{p}km1 : f32",
        f"%{p}lt = arith.cmpf olt, %{p}g2, %{p}g : f32", f"%{p}m = arith.select %{p}lt, %{p}g2, %{p}g : f32",
        f"%{p}mi = arith.bitcast %{p}m : f32 to i32", f"%{p}vi = arith.xori %{p}mi, %{p}sg : i32",
        f"{out} = arith.bitcast %{p}vi : i32 to f32",
    ]


#: :func:`f16_nibble_value_lines` yields the e2m1 value divided by this (2^14, a power of two: exact)
F16_NIBBLE_SCALE = 16384.0


def f16_nibble_value_lines(byte_i8: str, half_index: str, out: str, p: str = "fh") -> list[str]:
    """f32 value / :data:`F16_NIBBLE_SCALE` of nibble ``half_index`` (an index value, 0 = low) of the i8
    ``byte_i8``, through an f16 bit pattern and one hardware conversion (``vcvtph2ps`` with F16C).

    The code ``[s e1 e0 m]`` placed as f16 bits ``s << 15 | e << 10 | m << 9`` is
    ``(-1)^s 2^(e-15) (1 + m/2)`` for ``e > 0`` and the f16 subnormal ``(-1)^s m 2^-15`` for ``e == 0``:
    the e2m1 value times 2^-14 in both cases, with no select. Work is on i16 lanes (16 per vector):
    ``a = byte * 2^(12 - 4h)`` (a multiply, see below) puts the nibble at bits 12-15; an arithmetic
    ``a >> 3`` moves the magnitude to bits 9-11 and copies the sign into bits 12-15, so ``& 0x8E00`` (sign
    and magnitude bits) leaves exactly the f16 pattern: two vector ops. The caller multiplies the 2^14
    back in once per output.
    """
    return [
        f"%{p}q = arith.extui {byte_i8} : i8 to i16", f"%{p}h32 = arith.index_cast {half_index} : index to i32",
        # (index -> i16 directly makes IREE's vectorizer give up on the whole generic)
        f"%{p}h = arith.trunci %{p}h32 : i32 to i16",
        f"%{p}k4 = arith.constant 4 : i16", f"%{p}k12 = arith.constant 12 : i16", f"%{p}k3 = arith.constant 3 : i16",
        f"%{p}kbits = arith.constant -29184 : i16", f"%{p}k1 = arith.constant 1 : i16",
        f"%{p}h4 = arith.muli %{p}h, %{p}k4 : i16", f"%{p}sh = arith.subi %{p}k12, %{p}h4 : i16",
        # a multiply by 2^sh, not a shift: AVX2 has no per-lane i16 shift, and the shift-count extraction
        # LLVM emits for one (SSE4a ``extrq`` on znver) stalls on the AVX state
        f"%{p}m = arith.shli %{p}k1, %{p}sh : i16",
        f"%{p}a = arith.muli %{p}q, %{p}m : i16",
        f"%{p}b = arith.shrsi %{p}a, %{p}k3 : i16", f"%{p}c = arith.andi %{p}b, %{p}kbits : i16",
        f"%{p}f = arith.bitcast %{p}c : i16 to f16",
        f"{out} = arith.extf %{p}f : f16 to f32",
    ]


def scale_lines(s_i8: str, out: str, p: str = "sc") -> list[str]:
    """f32 value of the e8m0 byte ``s_i8`` (i8), exactly, including 0 (2^-127) and 255 (NaN).

    Branch-free, four ops: ``u = bits(b << 23 | 1 << 22)`` is ``1.5 * 2^(b-127)`` for 1..254, the
    subnormal 2^-127 for 0 and a quiet NaN for 255; ``v = bits(b << 23)`` is ``2^(b-127)``, 0 and inf.
    ``fma(v, -0.5, u) = u - v/2`` is then exactly ``2^(b-127)``, ``2^-127`` and NaN. (Compare + select was
    lowered to branches around constant loads in the matvec loop.)
    """
    return [
        f"%{p}q = arith.extui {s_i8} : i8 to i32", f"%{p}k23 = arith.constant 23 : i32",
        f"%{p}kbit = arith.constant 4194304 : i32", f"%{p}kh = arith.constant -0.5 : f32",
        f"%{p}b = arith.shli %{p}q, %{p}k23 : i32", f"%{p}b2 = arith.ori %{p}b, %{p}kbit : i32",
        f"%{p}v = arith.bitcast %{p}b : i32 to f32", f"%{p}u = arith.bitcast %{p}b2 : i32 to f32",
        f"{out} = math.fma %{p}v, %{p}kh, %{p}u : f32",
    ]


def nibble_lines(byte_i8: str, half_index: str, out: str, p: str = "nb") -> list[str]:
    """i32 whose low 4 bits are nibble ``half_index`` (an index value, 0 = low) of the i8 ``byte_i8``."""
    return [
        f"%{p}q = arith.extui {byte_i8} : i8 to i32", f"%{p}h = arith.index_cast {half_index} : index to i32",
        f"%{p}k4 = arith.constant 4 : i32", f"%{p}sh = arith.muli %{p}h, %{p}k4 : i32",
        f"{out} = arith.shrui %{p}q, %{p}sh : i32",
    ]


def scaling_extf_lines(f4: str, f8: str, out: str) -> list[str]:
    """The same value through ``arith.scaling_extf`` on f4E2M1FN / f8E8M0FNU elements."""
    return [f"{out} = arith.scaling_extf {f4}, {f8} : f4E2M1FN, f8E8M0FNU to f32"]


def e8m0_value_lines(s_f8: str, out: str, p: str = "ev") -> list[str]:
    """f32 value of the ``f8E8M0FNU`` scale ``s_f8`` with arith ops only (no ``math``: IREE clones a decode into
    the consumer's dispatch only when its body has none): ``bits(b << 23 | 1 << 22) - bits(b << 23) / 2``, i.e.
    ``2^(b-127)``, and ``2^-127`` for 0, NaN for 255, exactly (the idea of :func:`scale_lines`, its fma split)."""
    return [
        f"%{p}b8 = arith.bitcast {s_f8} : f8E8M0FNU to i8", f"%{p}q = arith.extui %{p}b8 : i8 to i32",
        f"%{p}k23 = arith.constant 23 : i32", f"%{p}kbit = arith.constant 4194304 : i32",
        f"%{p}kh = arith.constant -0.5 : f32", f"%{p}b = arith.shli %{p}q, %{p}k23 : i32",
        f"%{p}b2 = arith.ori %{p}b, %{p}kbit : i32", f"%{p}v = arith.bitcast %{p}b : i32 to f32",
        f"%{p}u = arith.bitcast %{p}b2 : i32 to f32", f"%{p}h = arith.mulf %{p}v, %{p}kh : f32",
        f"{out} = arith.addf %{p}u, %{p}h : f32",
    ]


#: twice the e2m1 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} as 4-bit fields of one i32, magnitude code m at bits 4m..4m+3
E2M1_TWICE_LUT = 0xC8643210


def e2m1_scaled_lines(f4: str, scale_f32: str, out: str, el: str, p: str = "eq") -> list[str]:
    """``el`` (bf16 or f32) value of the ``f4E2M1FN`` element ``f4`` times the f32 ``scale_f32``, with integer ops, one
    conversion and one multiply, exactly (the product has two significant bits: its bf16 is the top half of its f32).

    Twice the magnitude is a 4-bit field of the constant :data:`E2M1_TWICE_LUT` (a shift and a mask: one bit-field
    extract), converted to f32 and multiplied by half the scale; the sign bit is or-ed in. No intermediate subnormal
    (only the scales 2^-127 and 2^-126 give subnormal weights, which a target running with denormals flushed, like
    IREE's CPU, makes 0). Where the target has no instruction for ``arith.scaling_extf`` (gfx942) this is ~8 VALU
    instructions a value against ~28 for its expansion."""
    lines = [
        f"%{p}n4 = arith.bitcast {f4} : f4E2M1FN to i4", f"%{p}q = arith.extui %{p}n4 : i4 to i32",
        f"%{p}k7 = arith.constant 7 : i32", f"%{p}k2 = arith.constant 2 : i32", f"%{p}k8 = arith.constant 8 : i32",
        f"%{p}k15 = arith.constant 15 : i32", f"%{p}k28 = arith.constant 28 : i32",
        f"%{p}lut = arith.constant {E2M1_TWICE_LUT - (1 << 32)} : i32", f"%{p}kh = arith.constant 0.5 : f32",
        f"%{p}mag = arith.andi %{p}q, %{p}k7 : i32", f"%{p}sh = arith.shli %{p}mag, %{p}k2 : i32",
        f"%{p}l = arith.shrui %{p}lut, %{p}sh : i32", f"%{p}two = arith.andi %{p}l, %{p}k15 : i32",
        f"%{p}tf = arith.uitofp %{p}two : i32 to f32", f"%{p}hs = arith.mulf {scale_f32}, %{p}kh : f32",
        f"%{p}a = arith.mulf %{p}tf, %{p}hs : f32", f"%{p}ai = arith.bitcast %{p}a : f32 to i32",
        f"%{p}sg = arith.andi %{p}q, %{p}k8 : i32", f"%{p}sb = arith.shli %{p}sg, %{p}k28 : i32",
        f"%{p}vi = arith.ori %{p}ai, %{p}sb : i32",
    ]
    if el == "f32":
        return lines + [f"{out} = arith.bitcast %{p}vi : i32 to f32"]
    return lines + [
        f"%{p}k16 = arith.constant 16 : i32", f"%{p}hi = arith.shrui %{p}vi, %{p}k16 : i32",
        f"%{p}t16 = arith.trunci %{p}hi : i32 to i16", f"{out} = arith.bitcast %{p}t16 : i16 to {el}",
    ]
