"""CPU check (numpy) of the stored bit layout against an emulation of the decode PTX."""
import numpy as np
from bitlayout import GROUPS, stored_bit_map, target_bit
rng = np.random.default_rng(0)
pos = stored_bit_map()
codes = rng.integers(0, 16, size=(1000, 8))
words = np.zeros(1000, dtype=np.uint64)
for k in range(8):
    for b in range(4):
        words |= (((codes[:, k] >> b) & 1).astype(np.uint64) << np.uint64(pos[(k, b)]))
words = words.astype(np.uint32)
def rotl(w, r):
    return ((w << np.uint32(r)) | (w >> np.uint32(32 - r))) if r else w
def bf16_to_f(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
TAB = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
want = TAB[codes & 7] * np.where(codes & 8, -1, 1)
for j, groups in enumerate(GROUPS):
    t = np.zeros_like(words)
    for rot, bits in groups:
        m = 0
        for h, b in bits:
            m |= 1 << target_bit(h, b)
        t |= rotl(words, rot) & np.uint32(m)
    lo = bf16_to_f(t & np.uint32(0xFFFF)) * 2.0 ** 126
    hi = bf16_to_f(t >> np.uint32(16)) * 2.0 ** 126
    assert np.array_equal(lo, want[:, 2 * j]) and np.array_equal(hi, want[:, 2 * j + 1]), j
    # signed zero check
    assert np.array_equal(np.signbit(lo), (codes[:, 2 * j] & 8) > 0)
print("bit layout OK")
