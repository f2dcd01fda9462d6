"""Tile shapes for the grouped MXFP4 GEMMs, picked by a fixed rule (no run-time autotuning).

Autotuning at run time would compile several variants on first use and make ahead-of-time builds
depend on the machine they ran on; a fixed rule keeps both JIT and AOT builds reproducible.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: At or below this many (token, slot) rows per expert on average we are streaming weights
#: (memory-bound decode); above it, rows start to share weight tiles (compute-bound prefill).
DECODE_MAX_TOKENS = 64


@dataclass(frozen=True)
class TileConfig:
    """One tile shape. BLOCK_M is also the row padding of each expert's group (see grouping)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    #: load weight tiles through TMA descriptors where the layout allows (rows of values, and for w13
    #: interleaved gate/up rows); otherwise plain loads
    W_TMA: bool = False
    #: launch order of the (row block, column tile) programs: 0 = row blocks fastest (programs in flight
    #: share a weight tile); G > 0 = G row blocks across all column tiles at a time (programs in flight
    #: share activation rows), see ``_gemm_kernels._tile_coords``
    GROUP_M: int = 0
    #: the w2 GEMM's K (I) split over this many programs that add their partial sums (Hopper path only;
    #: see ``HOPPER_COMBINE_SPLIT_K``)
    SPLIT_K: int = 1
    #: sm_90 w4a8: K steps of fp8 MMAs chained into a fresh partial sum before it is added to the fp32 accumulator
    #: (0 = one chain over all of K; see ``_w4a8_kernels._w4a8_mma_hopper``)
    PROMOTE: int = 0
    #: Hopper path: a row block with at most this many rows (an expert's last, partly filled one) runs MMAs this
    #: narrow instead of BLOCK_M wide (0 = off; see ``_gemm_kernels.glu_gemm_kernel``)
    TAIL_M: int = 0

    def __post_init__(self) -> None:
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {v}")
        if self.GROUP_M < 0:
            raise ValueError(f"TileConfig.GROUP_M must be >= 0, got {self.GROUP_M}")
        if self.SPLIT_K < 1:
            raise ValueError(f"TileConfig.SPLIT_K must be >= 1, got {self.SPLIT_K}")
        if self.TAIL_M and (self.TAIL_M < 16 or self.TAIL_M & (self.TAIL_M - 1) or self.TAIL_M >= self.BLOCK_M):
            raise ValueError(f"TileConfig.TAIL_M must be 0 or a power of two >= 16 below BLOCK_M={self.BLOCK_M}, "
                             f"got {self.TAIL_M}")
        if self.BLOCK_K < 64:
            raise ValueError("TileConfig.BLOCK_K must be >= 64 (two MXFP4 scale groups per packed row)")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


#: At or below this many tokens a T x k grouped GEMM has about one routed row per expert (gpt-oss: k=4 of
#: 32-128 experts): the weight stream is everything, and narrow tiles spread it over the most CTAs.
GEMV_MAX_TOKENS = 4

#: Largest token count of the "mid" class, at least (see PREFILL_ROWS_PER_EXPERT).
MID_MAX_TOKENS = 1024

#: On the Hopper decode path with bf16 activations (``shape_classes(..., mid_rows_per_expert=)``, the planner) the
#: "mid" class (64-row tiles) also runs up to this many (token, slot) rows per expert on average (T * k / E): below
#: it the prefill class's 128-row tiles are mostly padding. H100, 2026-11-28, gpt-oss-120b (128 experts),
#: two alternations, both routings: at 2048 tokens (64 rows per expert) mid 1709-1924 us against prefill 1951-2500
#: (12-23% faster), at 4096 (128 rows) 2959-3023 against 2964-3279 (level to 9% faster), at 8192 (256 rows) 5-10%
#: slower; gpt-oss-20b (32 experts) at 2048-8192 tokens (256-1024 rows) mid was slower everywhere.
PREFILL_ROWS_PER_EXPERT = 128

#: On the same path, past this many (token, slot) rows per expert on average the rest of mid's range runs in the
#: "mid_wide" class: mid's launches on 128-row tiles (8 warps), an expert's last block of at most 64 rows on 64-row
#: MMAs (TAIL_M). H200, 2026-11-28, Triton 3.9 cubins, whole layer, eager calls alternated with the 64-row mid in
#: both orders (ratios mid / 128-row tiles): uniform routing 1.06 / 1.10 / 1.08 / 1.04 at 80 / 96 / 112 / 128 rows
#: per expert for gpt-oss-20b (640-1024 tokens) and 1.06 / 1.09 / 1.08 / 1.06 for gpt-oss-120b (2560-4096); skewed
#: 0.95 / 0.98 / 1.04 / 1.08 (20b) and 0.95 / 0.96 / 0.98 / 0.99 (120b); at 64 rows 0.93-1.06 (20b at 512: mixed)
#: and 0.93-0.97 (120b at 2048). So from 97 rows: uniform 4-9% faster, skewed between -2% and +8%.
MID_WIDE_ROWS_PER_EXPERT = 96

#: Past the decode class, up to this many (token, slot) rows per expert on average (T * k / E) the
#: "sparse" class runs: the weights are still streamed nearly once per forward, and 32-row tiles waste
#: less of each expert's tile than mid's 64 (gpt-oss-120b at 128-1024 tokens, 4-32 rows per expert, and
#: gpt-oss-20b at 128-256 tokens on the H100: 5-27% faster than mid's tiles).
SPARSE_ROWS_PER_EXPERT = 32

#: From this many (token, slot) rows per expert on average (T * k / E) the "large" class runs: 256-row
#: tiles halve the weight upcasts per FLOP, and its launch order keeps the activation rows, which no
#: longer fit in L2, read about once (on the H100 at gpt-oss-20b's 16384 tokens: -20%; at 128 rows per
#: expert the half-empty 256-row tiles were 13-30% slower).
LARGE_ROWS_PER_EXPERT = 512

#: The same on the Hopper path with the tiled words (``shape_classes(..., large_rows_per_expert=)``, the planner), whose
#: large tiles run an expert's last block of at most 128 rows on 128-row MMAs (``HOPPER_TAIL_M``), so a 256-row tile
#: with 129-255 rows decodes each weight tile once where two 128-row tiles decoded it twice. H200, 2026-11-29, Triton
#: 3.9 cubins, whole layer, eager calls, two alternations against large from 512 rows: gpt-oss-20b at 1280-3072 tokens
#: (160-384 rows) 5-15% faster (2048: 1239-1281 against 1407 us uniform), gpt-oss-120b at 5120-12288 2-8% faster
#: uniform (8192: 4178-4346 against 4484-4503) and between 5% slower (5120) and 5% faster skewed, E,k,H,I =
#: 8,2,4096,14336 at 768-1536 tokens (192-384 rows) 7-16% faster.
HOPPER_LARGE_ROWS_PER_EXPERT = 160


def shape_classes(num_experts: int, top_k: int, mid_rows_per_expert: int = 0, mid_wide_rows_per_expert: int = 0,
                  large_rows_per_expert: int = LARGE_ROWS_PER_EXPERT) -> tuple[tuple[str, int | None], ...]:
    """A layer's shape classes by token count, in order: (name, largest token count of the class or
    None). A kernel plan carries one tile config per class and GEMM; the runtime picks the class from T.
    Where "sparse" ends and "large" starts depends on the layer (rows per expert), so a class whose
    range is empty is left out. ``mid_rows_per_expert``: "mid" runs at least up to that many rows per expert
    (``PREFILL_ROWS_PER_EXPERT`` on the Hopper bf16 path), else to ``MID_MAX_TOKENS`` tokens.
    ``mid_wide_rows_per_expert`` (``MID_WIDE_ROWS_PER_EXPERT`` on that path; 0: none): past that many rows per
    expert the rest of mid's range is the "mid_wide" class, and mid's range ends at ``mid_rows_per_expert`` rows
    per expert even below ``MID_MAX_TOKENS`` tokens (layers of few experts, where 1024 tokens are 256+ rows per
    expert). "large" starts at ``large_rows_per_expert`` rows per expert (``HOPPER_LARGE_ROWS_PER_EXPERT`` on that
    path)."""
    if num_experts < 1 or top_k < 1:
        raise ValueError(f"need num_experts >= 1 and top_k >= 1, got {num_experts} and {top_k}")
    sparse_to = min(MID_MAX_TOKENS, SPARSE_ROWS_PER_EXPERT * num_experts // top_k)
    mid_rows = mid_rows_per_expert * num_experts // top_k
    mid_to = mid_rows if mid_rows and mid_wide_rows_per_expert else max(MID_MAX_TOKENS, mid_rows)
    narrow_to = min(mid_to, mid_wide_rows_per_expert * num_experts // top_k) if mid_wide_rows_per_expert else mid_to
    large_from = max(mid_to + 1, -(-large_rows_per_expert * num_experts // top_k))
    bounds = [("gemv", GEMV_MAX_TOKENS), ("decode", DECODE_MAX_TOKENS), ("sparse", sparse_to),
              ("mid", narrow_to), ("mid_wide", mid_to), ("prefill", large_from - 1)]
    classes, previous = [], 0
    for name, limit in bounds:
        if limit > previous:
            classes.append((name, limit))
            previous = limit
    return (*classes, ("large", None))


def use_tma(config: TileConfig, interleaved: bool = True, tiled: bool = False) -> bool:
    """Whether a GEMM loads its weight tiles through TMA: asked by the tile config and possible for the
    layout (a tile's weight rows must be consecutive rows; for w13 that needs the interleaved gate/up order;
    the tiled Hopper order is not rows at all)."""
    return bool(config.W_TMA and interleaved and not tiled)


def fused_cast(max_tokens: int | None) -> bool:
    """Whether a class's combine casts its own finished tiles (the last program per column tile; no cast
    launch). H100, 2026-11-24, three interleaved rounds of the same build with and without: 1 token
    47.5-47.9 vs 49.4-50.3 us (gpt-oss-20b), 49.9-50.5 vs 52.0-52.6 us (120b); at 8 and 64 tokens 0.5-1%
    slower (every program pays a barrier and an atomic, and the last one casts T rows alone), so only
    the gemv class fuses."""
    return max_tokens is not None and max_tokens <= GEMV_MAX_TOKENS


def is_few_tokens(max_tokens: int | None) -> bool:
    """Whether a class (by its largest token count) is memory-bound decode: its router splits H across
    programs, and the same launch routes and groups (``router_route_group`` / ``_scatter``: the last router
    program of each 16-token block routes it, the last block routed groups all pairs; see
    kernels/triton/planner.py). On the H100 routing and grouping in one program saved 4-9% of the whole layer
    at 1 token and the router folded in another 1-2%; at 8-64 tokens one program routing all 64 padded
    tokens had been 0-5% slower, which routing per 16-token block avoids."""
    return max_tokens is not None and max_tokens <= DECODE_MAX_TOKENS


#: Tiles of the Hopper decode path (weights decoded in registers as the MMA's left operand, so BLOCK_N
#: is the MMA's M: 64 rows per warpgroup), per class: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M,
#: weight tiles by TMA).
#: From AOT cubins timed on the H100 (docs/nvidia.md): at 1-64 tokens the 64 x 256 weight tile on one
#: warpgroup moved 1.7-2.1 TB/s where the dot_scaled tiles moved 1.2-1.5; at 16384 tokens the 256-row
#: tile ran the gpt-oss GEMMs at 478-493 TFLOP/s (dot_scaled: 381-387). TMA weight tiles (the last field)
#: work on this path too but were no faster in any class (within +-2%, mid and prefill 3-7% slower).
#: Since the tiled layout (mxmoe.core.layouts.TRITON_HOPPER_TILED) mid runs 4 warps: with 8 it was 5-6% slower
#: than on the row layout at 512 tokens, with 4 it is level (H100, 2026-11-24). Mid's K=64 / 4 stages: at 512
#: tokens 3% (20b) and 1% (120b) faster than K=128 / 3 stages on the w13 GEMM, 8% and 7% on the w2 GEMM (JIT
#: sweep on the H100 with Triton 3.6, 2026-11-25; benchmarks/gpu_moe.py --sweep). Prefill walks its row blocks in
#: groups of 4 (GROUP_M, as large) where its activation rows overflow L2: HOPPER_GROUPED_PREFILL_BYTES.
#: Large takes K steps of 128 in 3 stages (2026-11-29, H200, Triton 3.9 cubins, whole layer, two alternations against
#: K=64 / 4 stages): gpt-oss-20b at 4096 / 16384 tokens 2-6% / 2-3% faster (1987 / 6682-6728 against 2058-2064 /
#: 6874-6927 us uniform), gpt-oss-120b at 16384 level to 7% (skewed 7413-7460 against 7711-8021), and the untuned
#: shapes E,k,H,I = 8,2,4096,14336 at 4096 tokens and 128,8,4096,1536 at 16384 5-7%.
HOPPER_TILES = {
    "gemv": (16, 64, 256, 4, 3, 0, False),
    "decode": (16, 64, 256, 4, 3, 0, False),
    "sparse": (32, 128, 128, 4, 3, 0, False),
    "mid": (64, 128, 64, 4, 4, 0, False),
    "mid_wide": (128, 128, 64, 8, 4, 0, False),
    "prefill": (128, 128, 64, 8, 4, 4, False),
    "large": (256, 128, 128, 8, 3, 4, False),
}

#: The Hopper prefill class keeps its grouped launch order (HOPPER_TILES) only when the smallest batch of the class
#: has more than this many bytes of w2 input rows ([T*k, I] activations), which then no longer stay in L2 (50 MB on
#: the H100, 60 on the H200) across the column tiles. 2026-11-28, two alternations, both routings: gpt-oss-120b
#: (prefill 4097-16383 tokens, 94+ MB of rows) 4-10% faster on the H200 at 6144-12288 tokens (8192: 4266-4425 against
#: 4599-4670 us uniform) and 4-19% on the H100 (8192: 4497-4635 against 5169-5433, 12288: 6164-6460 against
#: 7541-7823); gpt-oss-20b (1025-4095 tokens, 24+ MB) level on the H200 (2048: 1214-1219 against 1199-1210) and 3-8%
#: slower skewed on the H100 (1328-1396 against 1292-1293).
HOPPER_GROUPED_PREFILL_BYTES = 64 << 20

#: Classes whose w2 GEMM splits K (I) in two on the Hopper path. At 1 token it has one program per
#: (expert, 64 columns): 180 for gpt-oss-20b, under 1.4 per SM; split in two, the H100 probe
#: (docs/nvidia.md) moved 1.49 instead of 1.27 TB/s. At 8 tokens there are enough programs already and the
#: split was 4% slower; the w13 GEMM gained nothing from splitting (and would need its GLU after the sum).
HOPPER_COMBINE_SPLIT_K = {"gemv": 2}

#: ...but only where each part keeps at least this many K steps: with fewer, a program's fixed work (its prologue, the
#: 3-stage pipeline's fill, the partial sums' atomics) outweighs the programs gained. H200, 2026-11-29, Triton 3.9
#: cubins, whole layer in CUDA graphs, split against unsplit in two alternations, both routings: E,k,H,I =
#: 64,8,2048,1024 (4 steps of 256: 2 + 2) unsplit 10-11% faster at 1 and 4 tokens (26.0 against 29.0 us at 1 token),
#: 128,8,4096,1536 (3 + 3) 7-11% (47.8 against 51.5; 4 tokens 117.5 against 131.8), 128,8,2048,768 (2 + 1) 11-13%
#: (26.3 against 29.6); gpt-oss-20b (I = 2880: 6 + 6) split 3-4% faster (36.6-36.9 against 37.9-38.2). Where between
#: 3 and 6 steps the split starts to pay is not measured.
HOPPER_SPLIT_K_MIN_STEPS = 4


#: From this reduction depth the Hopper mid_wide class's w2 GEMM (K = I) takes K steps of 128 in 3 stages instead of
#: 64 in 4: each step's fixed work (the scale tile's trip, barriers, MMA waits) is then spread over twice the MMAs.
#: H200, 2026-11-29, Triton 3.9 cubins, whole layer, two alternations: E,k,H,I = 8,2,4096,14336 (I = 14336) at 512 /
#: 768 tokens 5-6% / 7-12% faster (1008 against 1076-1078 us uniform at 512, in CUDA graphs); the w13 GEMM (K = H =
#: 4096) so tiled only 2% faster, and gpt-oss's (I = 2880) both GEMMs so tiled were 10-25% slower. Measured on that
#: one deep shape only.
HOPPER_DEEP_K = 8192

#: Classes whose Hopper GEMMs run an expert's last row block, when it holds at most this many rows, with MMAs this
#: narrow (``TileConfig.TAIL_M``). H200, 2026-11-28, Triton 3.9 cubins, whole layer, one round against the same
#: plans without it: the sparse class (32-row tiles, 4-32 rows per expert) 4-10% faster (gpt-oss-120b at 128 tokens
#: 721 -> 653 us uniform, 586 -> 545 skewed; at 512 834 -> 795 and 955 -> 901; gpt-oss-20b at 128 skewed 248 -> 238).
#: Mid (64-row tiles) with 16- or 32-row tails: level at 512 tokens for gpt-oss-20b (386 / 384 / 388 us), 2-5% at
#: 2048 for 120b; prefill with 32- or 64-row tails up to 24% slower at 2048 tokens for 20b: those classes keep one
#: width (docs/nvidia.md). Large with 128-row tails (H200, same day, two alternations, both routings): 4-9% faster
#: where the class starts (512 rows per expert: gpt-oss-20b at 4096 tokens 2047-2051 against 2177-2255 us uniform,
#: gpt-oss-120b at 16384 7648-7800 against 8008-8023), level at 2048 rows per expert (20b at 16384).
HOPPER_TAIL_M = {"sparse": 16, "mid_wide": 64, "large": 128}


def class_config(name: str, N: int, K: int, arch: int = 90, gemm: str = "glu", hopper: bool = False,
                 rows_bytes: int | None = None) -> TileConfig:
    """Tile shape of class ``name`` for grouped GEMM ``gemm`` ("glu": w13, "combine": w2) with output
    width ``N`` and reduction depth ``K``; ``hopper``: for the Hopper decode path (``HOPPER_TILES``),
    else for ``tl.dot_scaled``. ``rows_bytes``: the w2 input rows of the class's smallest batch (the Hopper prefill
    tiles group their launch order only past HOPPER_GROUPED_PREFILL_BYTES; None: as HOPPER_TILES says).

    BLOCK_M depends only on the class (never on the GEMM, N or K) so the w13 and w2 GEMMs of one
    forward agree on it: both read the same per-block expert map.
    """
    if gemm not in ("glu", "combine"):
        raise ValueError(f"gemm must be 'glu' or 'combine', got {gemm!r}")
    # The rows below were picked from AOT-compiled variants timed on an H100 (Triton 3.9 cubins,
    # ``benchmarks/gpu_moe.py --build DIR --variants ...`` then ``--breakdown``); see docs/nvidia.md.
    tma, group_m, split_k, tail_m = False, 0, 1, 0
    if hopper:
        if name not in HOPPER_TILES:
            raise ValueError(f"unknown shape class {name!r} (known: {', '.join(HOPPER_TILES)})")
        block_m, block_n, block_k, warps, stages, group_m, tma = HOPPER_TILES[name]
        tail_m = HOPPER_TAIL_M.get(name, 0)
        if name == "prefill" and rows_bytes is not None and rows_bytes <= HOPPER_GROUPED_PREFILL_BYTES:
            group_m = 0
        if gemm == "combine":
            split_k = HOPPER_COMBINE_SPLIT_K.get(name, 1)
            if -(-K // block_k) < split_k * HOPPER_SPLIT_K_MIN_STEPS:
                split_k = 1
            if name == "mid_wide" and K >= HOPPER_DEEP_K:
                block_k, stages = 128, 3
    elif name == "gemv":
        # About one row per expert: keep BLOCK_M at the MMA minimum, spread the weight stream over many
        # small CTAs (narrow N, 2 warps) and issue long K loads.
        block_m, block_n, block_k, warps, stages = 16, 32, 256, 2, 4
    elif name == "decode":
        # A few rows per expert (5-64 tokens): weights arrive by TMA in 64-wide N tiles (7-10% faster at
        # 8-64 tokens than 128-wide; 32-wide or 2 warps or K=512 were no better).
        block_m, block_n, block_k, warps, stages, tma = 16, 64, 256, 4, 3, True
    elif name == "sparse":
        # 4-32 rows per expert past 64 tokens: 32-row tiles, TMA weight tiles 128 wide and 128 deep;
        # the decode tile (16 x 64 x 256) was 8% faster still at 4-8 rows but 20-45% slower at 16-32.
        block_m, block_n, block_k, warps, stages, tma = 32, 128, 128, 4, 3, True
    elif name == "mid":
        # K=64 / 4 stages: 10-14% faster than K=128 / 3 stages at 512 tokens; TMA weight tiles another
        # 3-6% (in prefill they were 1-4% slower, so prefill keeps plain loads); 8 warps on both GEMMs
        # another 11-12% (8 warps on the w13 GEMM alone: half of that).
        block_m, block_n, block_k, warps, stages, tma = 64, 128, 64, 8, 4, True
    elif name == "prefill":
        # K=64 / 4 stages: 12-19% faster than K=128 / 8 warps / 3 stages at 16384 tokens; with K=64,
        # 8 warps are 2-3% faster than 4 for the w13 GEMM and 3-5% slower for the w2 GEMM. Grid order: grouped
        # (GROUP_M=8) was 11-14% slower when this path ran on the H100 (gpt-oss-20b, rows that fit L2); the Hopper
        # rows group where they do not (HOPPER_GROUPED_PREFILL_BYTES).
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8 if gemm == "glu" else 4, 4
    elif name == "large":
        # 256 rows (two warpgroups of 128) and grouped launch order: see LARGE_ROWS_PER_EXPERT.
        # Alone, the 256-row tile gave 2-8% and GROUP_M=8 at 128 rows 1-2%; together 19-22%. GROUP_M=4
        # another 1-3.5% over 8 (16: no better); 3 stages or BLOCK_K=128: no better / 8-9% slower.
        block_m, block_n, block_k, warps, stages, group_m = 256, 128, 64, 8, 4, 4
    else:
        raise ValueError(f"unknown shape class {name!r} (known: gemv, decode, sparse, mid, prefill, large)")
    if arch >= 100 and not hopper and name in ("mid", "prefill"):
        # Blackwell's native MXFP4 MMA likes wide N tiles; the operands stay within shared memory.
        # (Compile-only here: no Blackwell GPU has run these. "large" keeps 128-wide N: its 256 x 256
        # fp32 accumulator would fill all of tensor memory.)
        block_n = 256 if N >= 256 else block_n
        warps = max(warps, 8)
    # Don't tile far past tiny problems (tests, small models).
    block_n = max(16, min(block_n, _pow2_at_least(N)))
    block_k = max(64, min(block_k, _pow2_at_least(K)))
    return TileConfig(block_m, block_n, block_k, warps, stages, W_TMA=tma, GROUP_M=group_m, SPLIT_K=split_k,
                      TAIL_M=tail_m)


#: The one K step of every class's GEMMs in batch-invariant plans (``batch_invariant_config``).
BATCH_INVARIANT_BLOCK_K = 128


def batch_invariant_config(config: TileConfig, K: int) -> TileConfig:
    """``config`` reducing along K like every other class of a batch-invariant plan: BLOCK_K =
    :data:`BATCH_INVARIANT_BLOCK_K` (clamped to K as :func:`class_config` clamps) and no split K, so a token's
    output element is the same sequence of MMAs whatever class (tile) its batch runs in. BLOCK_M, BLOCK_N and the
    warps stay the class's: they choose which rows and columns an MMA covers, not how one element is summed.
    Pipelining depth drops to 3 where 4 stages of a 256-row tile at K = 128 would not fit in shared memory."""
    block_k = max(64, min(BATCH_INVARIANT_BLOCK_K, _pow2_at_least(K)))
    stages = config.num_stages
    if config.BLOCK_M * block_k * 2 * stages > 160 * 1024:
        stages = 3
    return dataclasses.replace(config, BLOCK_K=block_k, SPLIT_K=1, num_stages=stages)


def _k_steps(kernel: str, constexprs: dict) -> int:
    """Trips of a grouped GEMM's K loop: K (H for the w13 GEMM, I / SPLIT_K for the w2 one) over BLOCK_K."""
    k = constexprs["HIDDEN"] if kernel == "glu_gemm" else constexprs["INTERMEDIATE"] // constexprs.get("SPLIT_K", 1)
    return -(-k // constexprs["BLOCK_K"])


def compile_stages(kernel: str, constexprs: dict, num_stages: int, triton_version: str) -> int:
    """The software-pipelining depth to compile a plan kernel with, on this Triton version.

    Measured on an H100: with Triton 3.6, the grouped dot_scaled GEMMs at the prefill tile (BLOCK_M=128)
    and num_stages=4 returned wrong sums from 4096 tokens up, and num_stages=1 was right; Triton 3.9
    cubins of the same plan were right. So older Tritons compile those kernels unpipelined. On the Hopper
    decode path, Triton 3.6 ran every class right pipelined but one: an MXFP4 shared expert's w2 GEMM (one
    expert, 256-row tiles) whose K loop had exactly as many trips as stages (I = 256, BLOCK_K = 64, 4 stages)
    returned wrong rows for about half the tokens (H100 2026-11-25, H200 2026-11-28; 1, 2 or 3 stages right,
    and 3 or 5 trips right; Triton 3.9 right). So older Tritons pipeline a Hopper GEMM at most trips - 1 deep.
    And the mid_wide tiles (128 token rows on 8 warps with 64-row tails) came out of Triton 3.6 wrong at 4 and 3
    stages, JIT or AOT, a few rows a call and different ones each call (H200 2026-11-29, E,k,H,I = 32,4,512,768 at
    900 and 1024 tokens, both weight orders: 0-17 rows a call; 2 stages and no tails right in 10-15 calls each,
    Triton 3.9 cubins right; the large and sparse classes' tails right at their stages): there 2 stages.
    """
    major_minor = tuple(int(p) for p in triton_version.split("+")[0].split(".")[:2])
    if major_minor >= (3, 9) or kernel not in ("glu_gemm", "combine_gemm"):
        return num_stages
    if not constexprs.get("W_HOPPER"):
        return 1 if constexprs.get("BLOCK_M", 0) >= 128 else num_stages
    if constexprs.get("TAIL_M", 0) and constexprs.get("BLOCK_M") == 128:
        num_stages = min(num_stages, 2)
    return max(1, min(num_stages, _k_steps(kernel, constexprs) - 1))


#: Tiles of the w4a8 form (``activations="mxfp8"``, ``_w4a8_kernels``) per arch family and class: (BLOCK_M,
#: BLOCK_N, BLOCK_K, warps, stages, GROUP_M), held to what the native paths need:
#:
#: * sm_100: the block-scaled tcgen05 MMA takes an M operand of 128+ rows and 4 or 8 warps. Classes of 128+ token
#:   rows put the tokens first; smaller ones swap (weights first, BLOCK_N = 128, tokens as the MMA's N: 16-64
#:   run natively, 8 would not). K steps of 128 (4 scale groups). Tensor memory holds 512 fp32 columns: 128 x 256
#:   and 256 x 128 accumulators fit, 256 x 256 does not (Triton then emits a kernel that traps).
#: * sm_90: fp8 wgmma with the weights decoded in registers as its left operand (64 rows a warpgroup); K steps of
#:   128 (two MMAs of 64: the decode's two halves, ``_w4a8_kernels._hopper_fp8_weights``), one step for every class
#:   (the quantizers lay the activations out by it). Timed on the H100 (2026-11-25, gpt-oss-20b / -120b, T = 512 -
#:   16384): 256 token rows from 1024 tokens on (the decode of a weight tile serves twice the MMA work; 20b 4096
#:   tokens 1.95 vs 2.42 ms at 128 rows, 16384 5.2 vs 7.6 ms; 120b 4096 2.82 vs 3.16 ms, 2048 2.52 vs 2.27 ms),
#:   4 warps in "mid" (20b 512 tokens 427 vs 511 µs); K steps of 64 were 15-25% slower everywhere.
W4A8_TILES = {
    100: {"gemv": (16, 128, 128, 4, 3, 0), "decode": (16, 128, 128, 4, 3, 0), "sparse": (32, 128, 128, 4, 3, 0),
          "mid": (64, 128, 128, 4, 3, 0), "prefill": (128, 256, 128, 8, 3, 0), "large": (256, 128, 128, 8, 3, 4)},
    90: {"gemv": (16, 128, 128, 4, 4, 0), "decode": (16, 128, 128, 4, 4, 0), "sparse": (32, 128, 128, 4, 4, 0),
         "mid": (64, 128, 128, 4, 4, 0), "prefill": (256, 128, 128, 8, 3, 0), "large": (256, 128, 128, 8, 3, 4)},
}
#: sm_90 w4a8: K steps per fp32 promotion of the fp8 MMA chain, per class (``TileConfig.PROMOTE``; absent = 0, one
#: chain over all of K). H200, 2026-11-27: promoting every step halves the small classes' error against the mxfp8
#: reference (gpt-oss-20b, 1 / 8 / 64 tokens: 4.6e-3 / 8.4e-3 / 6.8e-3 against 9.2e-3 / 1.7e-2 / 1.1e-2) at +4 µs for
#: one token and -2 to -6% at 8-64; mid spills 20-25 registers with it (11% slower at 512 tokens), prefill and large
#: 150-170 (1.8x slower at 4096), so they keep one chain (docs/nvidia.md, the w4a8 form).
W4A8_PROMOTE_SM90 = {"gemv": 1, "decode": 1, "sparse": 1}
#: the smallest token tile the sm_100 block-scaled MMA takes as its M operand (smaller ones swap operands)
NATIVE_MMA_M = 128


def w4a8_config(name: str, N: int, K: int, arch: int, gemm: str = "glu") -> TileConfig:
    """Tile of class ``name`` for the w4a8 GEMM ``gemm`` (output width ``N``, depth ``K``) on ``sm_<arch>``:
    :data:`W4A8_TILES`, BLOCK_N narrowed for small layers except where it is the native MMA's M operand
    (sm_100 swapped tiles), BLOCK_K never (a multiple of the scale groups and of the sm_90 decode's halves)."""
    family = 100 if arch >= 100 else 90
    if name not in W4A8_TILES[family]:
        raise ValueError(f"unknown shape class {name!r} (known: {', '.join(W4A8_TILES[family])})")
    block_m, block_n, block_k, warps, stages, group_m = W4A8_TILES[family][name]
    if gemm == "combine":  # a 128 x 256 fp32 tile spilled in the combine's epilogue (SASS: STL/LDL)
        block_n = min(block_n, 128)
    if family == 100:
        floor = NATIVE_MMA_M if block_m < NATIVE_MMA_M else 64
    else:
        floor = 64
    block_n = max(floor, min(block_n, _pow2_at_least(N)))
    promote = W4A8_PROMOTE_SM90.get(name, 0) if family == 90 else 0
    return TileConfig(block_m, block_n, block_k, warps, stages, GROUP_M=group_m, PROMOTE=promote)
