"""Grouping (token, slot) pairs by expert for the grouped GEMMs, without reading anything back to the host.

A pair whose expert id is negative (-1: another rank's expert, or an id outside the layer) is in no group: no
row, no work, no weight bytes. The result: ``sorted_pairs[r]`` is the flat pair index t*k + j of sorted row r (rows [offsets[e],
offsets[e+1]) belong to expert e, in pair order); block b of the padded row space (each expert's rows padded
to BLOCK_M) covers sorted rows ``block_start[b] + [0, BLOCK_M)`` clipped to its expert's end, and
``block_expert[b] == -1`` marks a block past the last group (its programs exit at once). Every size is a
static bound from (T, k, E, BLOCK_M), so launch grids never wait on the GPU.
"""

import triton
import triton.language as tl


@triton.jit
def _expert_offsets_and_block_map(counts, experts, lanes, num_blocks, expert_offsets_ptr, block_expert_ptr,
                                  block_start_ptr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
                                  STEP: tl.constexpr):
    """From per-expert pair counts: store expert_offsets (E + 1 exclusive-scan entries) and the block map
    (each BLOCK_M block of the padded row space -> its expert and first sorted row; blocks past the last
    group get expert -1). Returns each expert's first sorted row. ``lanes`` is ``tl.arange(0, STEP)``."""
    ends = tl.cumsum(counts, axis=0)
    begins = ends - counts
    tl.store(expert_offsets_ptr + 1 + experts, ends, mask=experts < NUM_EXPERTS)
    tl.store(expert_offsets_ptr + experts, begins, mask=experts == 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_ends = tl.cumsum(blocks, axis=0)
    # First sorted row of an expert's j-th block is begins + j*BLOCK_M = b*BLOCK_M + row_shift.
    row_shift = begins - (block_ends - blocks) * BLOCK_M
    for start in range(0, num_blocks, STEP):
        b = start + lanes
        owner = tl.sum((block_ends[None, :] <= b[:, None]).to(tl.int32), axis=1)
        shift = tl.sum(tl.where(experts[None, :] == owner[:, None], row_shift[None, :], 0), axis=1)
        valid = b < num_blocks
        tl.store(block_expert_ptr + b, tl.where(owner < NUM_EXPERTS, owner, -1), mask=valid)
        tl.store(block_start_ptr + b, b * BLOCK_M + shift, mask=valid)
    return begins


@triton.jit
def group_by_expert_kernel(ids_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr,
                           block_start_ptr, num_pairs, num_blocks,
                           NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                           BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """:func:`group_pairs` as a kernel of one program: decode-class plans built before 2026-11-24 launch it
    (their JIT fallback needs it); plans now sort inside the router launch."""
    group_pairs(ids_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_pairs,
                num_blocks, NUM_EXPERTS, EXPERTS_POW2, BLOCK_M, CHUNK)


@triton.jit
def group_pairs(ids_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_pairs,
                num_blocks, NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                CHUNK: tl.constexpr):
    """A stable counting sort of (token, slot) pairs by expert, in one program.

    Pass 1 counts pairs per expert; pass 2 places each pair at its expert's offset plus its rank
    among earlier pairs of the same expert (a cumsum of one-hot rows), so the order inside a group
    is the pair order and the result is the same on every run. Pass 3 maps each BLOCK_M block of
    the padded row space to (expert, first sorted row); blocks past the last group get expert -1.
    One program keeps it free of atomics and inter-CTA sync; it reads ids twice, which is cheap
    next to the GEMMs for the token counts of an MoE layer.
    """
    experts = tl.arange(0, EXPERTS_POW2)
    lanes = tl.arange(0, CHUNK)

    counts = tl.zeros([EXPERTS_POW2], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    begins = _expert_offsets_and_block_map(counts, experts, lanes, num_blocks, expert_offsets_ptr, block_expert_ptr,
                                           block_start_ptr, NUM_EXPERTS, BLOCK_M, CHUNK)

    placed = tl.zeros([EXPERTS_POW2], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        valid = pairs < num_pairs
        ids = tl.load(ids_ptr + pairs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot
        dest = tl.sum(onehot * (rank + (begins + placed)[None, :]), axis=1)
        tl.store(sorted_pairs_ptr + dest, pairs, mask=valid & (ids >= 0))  # -1: not this layer's expert
        placed += tl.sum(onehot, axis=0)


# ----------------------------------------------------------- the same grouping, from per-block counts
# The few-token router launch (router_route_scatter_kernel) routes 16-token blocks in parallel programs.
# Each of those counts its own block's pairs (block_pair_counts) while the other blocks are still routing,
# so the last block routed only adds up a few count rows and scatters (scatter_by_block_counts): no walk
# over all pairs with one-hot column scans on the launch's critical path.

@triton.jit
def block_pair_counts(ids_ptr, block_counts_ptr, ranks_ptr, num_pairs, block,
                      PAIRS_PER_BLOCK: tl.constexpr, BLOCK_PAIRS: tl.constexpr, EXPERTS_POW2: tl.constexpr):
    """For token block ``block`` (pairs ``block * PAIRS_PER_BLOCK + [0, PAIRS_PER_BLOCK)``, BLOCK_PAIRS a
    power of two >= PAIRS_PER_BLOCK): block_counts[block, e] = its pairs on expert e, and ranks[p] = the
    pairs before p in the block on p's expert."""
    q = tl.arange(0, BLOCK_PAIRS)
    pairs = block * PAIRS_PER_BLOCK + q
    valid = (q < PAIRS_PER_BLOCK) & (pairs < num_pairs)
    ids = tl.load(ids_ptr + pairs, mask=valid, other=-1)
    experts = tl.arange(0, EXPERTS_POW2)
    counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + block * EXPERTS_POW2 + experts, counts)
    earlier = (ids[:, None] == ids[None, :]) & (q[None, :] < q[:, None])  # [p, q]: q before p, same expert
    tl.store(ranks_ptr + pairs, tl.sum(earlier.to(tl.int32), axis=1), mask=valid)


@triton.jit
def scatter_by_block_counts(ids_ptr, ranks_ptr, block_counts_ptr, sorted_pairs_ptr, expert_offsets_ptr,
                            block_expert_ptr, block_start_ptr, num_tokens, num_pairs, num_blocks, num_token_blocks,
                            NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                            TOKEN_BLOCKS_POW2: tl.constexpr, PAIRS_PER_BLOCK: tl.constexpr,
                            BLOCK_M: tl.constexpr, LANES: tl.constexpr):
    """:func:`group_pairs`'s result from the ``num_token_blocks`` rows of :func:`block_pair_counts`: a pair's
    sorted row is its expert's offset + the expert's pairs in earlier blocks + its rank in its block (so the
    order inside a group is the pair order, as there). Reads what other programs wrote: the caller acquires
    first. The block map stores each expert's blocks directly: an expert has at most T pairs (a token's k
    experts are distinct), so at most cdiv(T, BLOCK_M) blocks."""
    experts = tl.arange(0, EXPERTS_POW2)
    blocks_of = tl.arange(0, TOKEN_BLOCKS_POW2)
    table = block_counts_ptr + blocks_of[:, None] * EXPERTS_POW2 + experts[None, :]
    in_table = (blocks_of < num_token_blocks)[:, None]
    per_block = tl.load(table, mask=in_table, other=0, cache_modifier=".cg")
    counts = tl.sum(per_block, axis=0)
    ends = tl.cumsum(counts, axis=0)
    begins = ends - counts
    tl.store(expert_offsets_ptr + 1 + experts, ends, mask=experts < NUM_EXPERTS)
    tl.store(expert_offsets_ptr + experts, begins, mask=experts == 0)
    first_rows = begins[None, :] + tl.cumsum(per_block, axis=0) - per_block
    tl.debug_barrier()  # every count is read before the table turns into first rows
    tl.store(table, first_rows, mask=in_table)

    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first_block = tl.cumsum(blocks, axis=0) - blocks
    for j in range(0, (num_tokens + BLOCK_M - 1) // BLOCK_M):
        here = j < blocks
        tl.store(block_expert_ptr + first_block + j, experts, mask=here)
        tl.store(block_start_ptr + first_block + j, begins + j * BLOCK_M, mask=here)
    for b0 in range(tl.sum(blocks, axis=0), num_blocks, EXPERTS_POW2):  # past the last group
        b = b0 + experts
        tl.store(block_expert_ptr + b, tl.full([EXPERTS_POW2], -1, tl.int32), mask=b < num_blocks)
        tl.store(block_start_ptr + b, b * BLOCK_M, mask=b < num_blocks)

    tl.debug_barrier()  # the first rows stored above are read back by other threads
    for p0 in range(0, num_pairs, LANES):
        pairs = p0 + tl.arange(0, LANES)
        valid = pairs < num_pairs
        ids = tl.load(ids_ptr + pairs, mask=valid, other=-1, cache_modifier=".cg")
        valid &= ids >= 0  # -1: not this layer's expert (expert parallelism), never placed
        rank = tl.load(ranks_ptr + pairs, mask=valid, other=0, cache_modifier=".cg")
        first = tl.load(block_counts_ptr + (pairs // PAIRS_PER_BLOCK) * EXPERTS_POW2 + ids, mask=valid, other=0,
                        cache_modifier=".cg")
        tl.store(sorted_pairs_ptr + first + rank, pairs, mask=valid)


# ----------------------------------------------------------------- the same grouping, in parallel
# For many tokens the one-program kernel above is the bottleneck (it walks every pair twice on one
# SM). These three kernels compute the same result (same stable order, same block map): per-chunk
# histograms in parallel, one small scan, then a parallel scatter.

@triton.jit
def chunk_histogram_kernel(ids_ptr, chunk_counts_ptr, num_pairs,
                           EXPERTS_POW2: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """chunk_counts[c, e] = number of pairs of expert e among pairs [c*CHUNK, (c+1)*CHUNK)."""
    c = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_POW2)
    counts = tl.zeros([EXPERTS_POW2], tl.int32)
    for start in range(0, CHUNK, SUB):
        pairs = c * CHUNK + start + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + c * EXPERTS_POW2 + experts, counts)


@triton.jit
def chunk_scan_kernel(chunk_counts_ptr, chunk_offsets_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr,
                      num_chunks, num_blocks,
                      NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                      SUB: tl.constexpr):
    """One program: expert offsets, each chunk's first sorted row per expert (chunk_offsets [NC, E]),
    and the block map, exactly as ``group_by_expert_kernel`` lays them out."""
    experts = tl.arange(0, EXPERTS_POW2)
    lanes = tl.arange(0, SUB)
    counts = tl.zeros([EXPERTS_POW2], tl.int32)
    for c0 in range(0, num_chunks, SUB):
        chunks = c0 + lanes
        tile = tl.load(chunk_counts_ptr + chunks[:, None] * EXPERTS_POW2 + experts[None, :],
                       mask=(chunks < num_chunks)[:, None], other=0)
        counts += tl.sum(tile, axis=0)
    begins = _expert_offsets_and_block_map(counts, experts, lanes, num_blocks, expert_offsets_ptr, block_expert_ptr,
                                           block_start_ptr, NUM_EXPERTS, BLOCK_M, SUB)

    running = begins
    for c0 in range(0, num_chunks, SUB):
        chunks = c0 + lanes
        mask = (chunks < num_chunks)[:, None]
        offs = chunks[:, None] * EXPERTS_POW2 + experts[None, :]
        tile = tl.load(chunk_counts_ptr + offs, mask=mask, other=0)
        before = tl.cumsum(tile, axis=0) - tile
        tl.store(chunk_offsets_ptr + offs, running[None, :] + before, mask=mask)
        running += tl.sum(tile, axis=0)


@triton.jit
def chunk_scatter_kernel(ids_ptr, chunk_offsets_ptr, sorted_pairs_ptr, num_pairs,
                         EXPERTS_POW2: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Place chunk c's pairs: sorted row = the chunk's first row for the expert + rank within the chunk."""
    c = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_POW2)
    placed = tl.load(chunk_offsets_ptr + c * EXPERTS_POW2 + experts)
    for start in range(0, CHUNK, SUB):
        pairs = c * CHUNK + start + tl.arange(0, SUB)
        valid = pairs < num_pairs
        ids = tl.load(ids_ptr + pairs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot
        dest = tl.sum(onehot * (rank + placed[None, :]), axis=1)
        tl.store(sorted_pairs_ptr + dest, pairs, mask=valid & (ids >= 0))  # -1: not this layer's expert
        placed += tl.sum(onehot, axis=0)


# ------------------------------------------------ ids from the engine (modular entry), and the shared expert

@triton.jit
def _map_ids(ids_ptr, map_ptr, out_ptr, pairs, valid, NUM_GLOBAL: tl.constexpr, HAS_MAP: tl.constexpr):
    """out[p] = this layer's id of the engine's global id ids[p] (through the expert map with HAS_MAP), or -1 for an
    id outside [0, NUM_GLOBAL) (an engine's skip sentinel) or another rank's expert."""
    ids = tl.load(ids_ptr + pairs, mask=valid, other=-1)
    inside = valid & (ids >= 0) & (ids < NUM_GLOBAL)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=inside, other=-1)
    tl.store(out_ptr + pairs, tl.where(inside, ids, -1), mask=valid)


@triton.jit
def map_ids_kernel(ids_ptr, map_ptr, out_ptr, num_pairs, NUM_GLOBAL: tl.constexpr, HAS_MAP: tl.constexpr,
                   BLOCK: tl.constexpr):
    """:func:`_map_ids` on BLOCK pairs a program (many tokens; grouping follows in launches of its own)."""
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _map_ids(ids_ptr, map_ptr, out_ptr, pairs, pairs < num_pairs, NUM_GLOBAL, HAS_MAP)


@triton.jit
def map_and_group_kernel(ids_ptr, map_ptr, out_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr,
                         block_start_ptr, num_pairs, num_blocks, NUM_GLOBAL: tl.constexpr, HAS_MAP: tl.constexpr,
                         NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                         CHUNK: tl.constexpr):
    """Few tokens, one program: :func:`_map_ids` on every pair, then :func:`group_pairs` of the mapped ids."""
    for p0 in range(0, num_pairs, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        _map_ids(ids_ptr, map_ptr, out_ptr, pairs, pairs < num_pairs, NUM_GLOBAL, HAS_MAP)
    tl.debug_barrier()  # the ids just stored are read back by other threads
    group_pairs(out_ptr, sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_pairs,
                num_blocks, NUM_EXPERTS, EXPERTS_POW2, BLOCK_M, CHUNK)


@triton.jit
def dense_groups_kernel(sorted_pairs_ptr, expert_offsets_ptr, block_expert_ptr, block_start_ptr, num_tokens, num_blocks,
                        BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """The groups of the shared expert: every token on expert 0 (sorted row r = token r), BLOCK_M-row blocks, blocks
    past the tokens -1; the grouped GEMMs then run it like a routed expert."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sorted_pairs_ptr + i, i, mask=i < num_tokens)
    tl.store(block_expert_ptr + i, tl.where(i * BLOCK_M < num_tokens, 0, -1), mask=i < num_blocks)
    tl.store(block_start_ptr + i, i * BLOCK_M, mask=i < num_blocks)
    tl.store(expert_offsets_ptr + i, tl.where(i == 0, 0, num_tokens), mask=i < 2)
