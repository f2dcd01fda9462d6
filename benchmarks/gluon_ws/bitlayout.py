"""Offline bit layout of the stored MXFP4 words and the PTX that decodes them (no Triton import)."""

# ---- offline bit layout of one stored 32-bit word (8 codes, k = 8c .. 8c+7 of one weight row) -------------
# decoded pair j (k = 2j lo half, 2j+1 hi half) needs, in its b32 register, code bits at:
#   lo: sign->15, e1->8, e0->7, m->6 ; hi: sign->31, e1->24, e0->23, m->22   (bf16 bits = value * 2^-126)
# pair j = rotl(word, ROT_j) & MASK_j ; pair 3 has two groups (found by a search over the rotations).
TARGET_LO = {3: 15, 2: 8, 1: 7, 0: 6}   # code bit -> bf16 bit
GROUPS = [  # per pair: list of (rotation, [(half, codebit), ...]) ; half 0 = lo (even k), 1 = hi
    [(0, [(h, b) for h in (0, 1) for b in range(4)])],
    [(4, [(h, b) for h in (0, 1) for b in range(4)])],
    [(10, [(h, b) for h in (0, 1) for b in range(4)])],
    [(6, [(h, b) for h in (0, 1) for b in (0, 1, 3)]), (14, [(0, 2), (1, 2)])],
]


def target_bit(half, codebit):
    return TARGET_LO[codebit] + 16 * half


def stored_bit_map():
    """{(k in 0..7, codebit): stored bit position in the word}."""
    m = {}
    for j, groups in enumerate(GROUPS):
        for rot, bits in groups:
            for half, b in bits:
                m[(2 * j + half, b)] = (target_bit(half, b) - rot) % 32
    assert len(set(m.values())) == 32
    return m


def decode_asm(wide: bool) -> str:
    lines = [".reg .b32 t, u, z, b;", "mov.b32 z, 0x80008000;", "mov.b32 b, 0x7E807E80;"]
    for j, groups in enumerate(GROUPS):
        for gi, (rot, bits) in enumerate(groups):
            reg = "tu"[gi]
            mask = 0
            for half, b in bits:
                mask |= 1 << target_bit(half, b)
            src = "$4"
            if rot:
                lines.append(f"shf.l.wrap.b32 {reg}, $4, $4, {rot};")
                src = reg
            lines.append(f"and.b32 {reg}, {src}, {mask:#010x};")
        if len(groups) == 2:
            lines.append("or.b32 t, t, u;")
        if wide:
            lines.append("fma.rn.bf16x2 t, t, b, z;")
        lines.append(f"fma.rn.bf16x2 ${j}, t, $5, z;")  # a*f + (-0) == a*f exactly, signed zeros too
    return "{\n" + "\n".join(lines) + "\n}"


ASM_WIDE = decode_asm(True)
ASM_FAST = decode_asm(False)
