"""The planner of the Triton kernels: one MoE layer (:class:`LayerSpec`) and an arch -> a :class:`KernelPlan`.

The one place that decides which kernels run, with which constants, tiles and grids, for every token-count
class of a layer (gemv / decode / sparse / mid / prefill / large, from :mod:`.tile_config`). The compiler
calls it on the layer it matched in the IR (``mxmoe.compiler.triton_plan``), the tests on layers they make
up, and both get the same plan for the same layer. Plain Python: no torch, no triton, no MLIR.

A plan per class: the router launches (split along H for few tokens, where the same launch also routes and
groups), the grouping launches (many tokens), the w13 GEMM with its GLU, the w2 GEMM with the combine, and
the cast of the fp32 accumulator; every size is an expression of the token count ``T``, so the executor never
reads a device value back and a forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from mxmoe.core.bridge import numpy_dtype
from mxmoe.core.layouts import ROW_MAJOR, TRITON_HOPPER, TRITON_HOPPER_TILED, Layout, get_layout
from mxmoe.core.swizzle import HOPPER_MAX_FAST_SCALE

from .kernel_plan import (Arg, Buffer, KernelPlan, KernelSpec, LayerInfo, Launch, Parameter, PlanError, PlanInput,
                          PlanOptions, ShapeClass)
from .tile_config import (GEMV_MAX_TOKENS, HOPPER_LARGE_ROWS_PER_EXPERT, LARGE_ROWS_PER_EXPERT,
                          MID_WIDE_ROWS_PER_EXPERT, NATIVE_MMA_M, PREFILL_ROWS_PER_EXPERT, TileConfig,
                          batch_invariant_config, class_config, fused_cast, is_few_tokens, shape_classes, use_tma,
                          w4a8_config)

#: The weight layouts the GEMMs read: the checkpoint's order (``tl.dot_scaled``, sm_100) and the Hopper words
#: decoded in registers, in row order or tiled (sm_90). The kernels take their flags from the layout.
KERNEL_LAYOUTS: tuple[Layout, ...] = (ROW_MAJOR, TRITON_HOPPER, TRITON_HOPPER_TILED)
#: (token, slot) pairs per program of the parallel grouping kernels, at most (:func:`group_chunk`)
GROUP_CHUNK = 1024
#: programs the parallel grouping kernels aim at for a class's largest token count (:func:`group_chunk`)
GROUP_PROGRAMS = 64
#: tokens per router program in the few-token classes (also one routing counter per such block)
FEW_TOKEN_ROUTER_BLOCK = 16
#: H per router program in the few-token classes, loaded in one step. H100, gpt-oss, 2026-11-24 (the router
#: launch alone, CUPTI): 256 in four 64-wide steps 9.7 us at 1 token; one 256-wide step 8.0; 128 8.0; 64 8.1
#: (all with the grouping below still at CHUNK 256).
FEW_TOKEN_ROUTER_H = 128
#: Largest token count whose class routes through the split router (:func:`_split_router`) rather than
#: ``router_route``: at 512 tokens of gpt-oss-20b, ``router_route`` has 8 programs and took 32.7 of the layer's
#: 393 us on the H100 (CUPTI timeline, 2026-11-25); the split router has a program per 16 tokens and 128 of H.
SPLIT_ROUTER_MAX_TOKENS = 1024
#: Tokens per ``route_partials`` program, at most (and at most 4096 logits; the few-token launches route blocks of
#: their own): more programs to load the split sums and pick the top k of a few hundred tokens. H200 2026-11-28, 512
#: tokens, CUPTI: 16 instead of 32-64 took gpt-oss-120b's launch from 19.2 to 7.8 us, 20b's from 6.8 to 3.1.
ROUTE_BLOCK_T = 16
#: One-hot entries (the decode class's largest pair count x the experts, a power of two) from which its router launch
#: groups from per-block counts, whatever the expert count (:func:`few_token_scatter`): 64 tokens x top-8 x 64 experts
FEW_TOKEN_SCATTER_ONE_HOT = 32768
#: Tokens x columns per program of the deterministic combine (``combine_slots``)
SLOTS_BLOCK_T, SLOTS_BLOCK_H = 16, 256
#: (token, slot) pairs per program of ``map_ids`` (the modular entry's ids, many tokens)
MAP_BLOCK = 1024
#: Elements per program of the cast: 32 per thread at 4 warps. (At 1024, gpt-oss-20b's 16384-token
#: cast ran at 1.26 TB/s: the programs were too short.)
CAST_BLOCK = 4096


@dataclass(frozen=True)
class StoredWeight:
    """A weight parameter as stored for the kernels: its name (the artifact's / compiler's global), shape and
    dtype (plan dtype names: "uint8", "bfloat16", ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class LayerSpec(LayerInfo):
    """What the kernels need to know of one MoE layer entry: its semantics (:class:`LayerInfo`: E, k, H, I, routing,
    activation, gate/up order, activation dtype, weight layout, the entry, expert map, router weight on input, shared
    expert) and the stored weights holding its router and experts (absent ones None: biases, the router of an
    engine-routed entry, the routed experts of the shared-expert entry, the map, the shared expert)."""

    router_weight: StoredWeight | None
    w13: StoredWeight | None
    w13_scale: StoredWeight | None
    w2: StoredWeight | None
    w2_scale: StoredWeight | None
    router_bias: StoredWeight | None = None
    w13_bias: StoredWeight | None = None
    w2_bias: StoredWeight | None = None
    expert_map: StoredWeight | None = None
    shared_w13: StoredWeight | None = None
    shared_w13_scale: StoredWeight | None = None
    shared_w2: StoredWeight | None = None
    shared_w2_scale: StoredWeight | None = None
    shared_gate_weight: StoredWeight | None = None
    #: "sigmoid_topk"'s correction bias [E_global] fp32 (added to the scores for choosing only)
    score_bias: StoredWeight | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float32"):
            raise PlanError(f"the Triton kernels take bf16 or fp32 hidden states, not {self.dtype}")
        if self.entry not in ENTRY_KINDS:
            raise PlanError(f"unknown entry kind {self.entry!r} (known: {', '.join(ENTRY_KINDS)})")
        kernel_layout(self.layout)
        need = {"layer": ("router_weight", "w13", "w2"), "monolithic": ("w13", "w2"), "modular": ("w13", "w2"),
                "shared": ("shared_w13", "shared_w2")}[self.entry]
        if self.shared_format not in ("mxfp4", "bf16"):
            raise PlanError(f"shared_format must be 'mxfp4' or 'bf16', got {self.shared_format!r}")
        if self.shared_intermediate:
            need += ("shared_w13", "shared_w2") + (("shared_w13_scale", "shared_w2_scale") if self.mxfp4_shared
                                                    else ())
        missing = [n for n in need if getattr(self, n) is None]
        if missing:
            raise PlanError(f"a {self.entry} entry needs the weights {', '.join(missing)}")
        if self.weight_on_input and self.top_k != 1:
            raise PlanError(f"router weight on input needs top_k 1, got {self.top_k}")
        if self.shared_gate and self.shared_gate_weight is None:
            raise PlanError("a gated shared expert needs its gate weight")
        if self.routing not in ROUTINGS:
            raise PlanError(f"routing {self.routing!r} is not one the Triton kernels run (known: "
                            f"{', '.join(ROUTINGS)})")
        if self.activation not in ACTIVATIONS:
            raise PlanError(f"activation {self.activation!r} is not one the Triton kernels run (known: "
                            f"{', '.join(ACTIVATIONS)})")
        if (self.score_bias is not None or self.n_group != 1) and self.routing != "sigmoid_topk":
            raise PlanError(f"a correction bias and expert groups are 'sigmoid_topk''s, not {self.routing!r}'s")

    @property
    def mxfp4_shared(self) -> bool:
        """Whether the shared expert's weights are MXFP4 (else in the activation dtype: :func:`_dense_shared`)."""
        return self.shared_format == "mxfp4"

    def info(self) -> LayerInfo:
        return LayerInfo(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LayerInfo)})

    @property
    def routed(self) -> bool:
        """Whether the entry runs the routed experts (all but the shared expert alone)."""
        return self.entry != "shared"


#: The routings the routing kernels run (``SIGMOID`` of ``_select_and_store``: 0 the softmax ones, 1, 2)
ROUTINGS = {"topk_softmax": 0, "softmax_topk": 0, "topk_sigmoid": 1, "sigmoid_topk": 2}
#: The GLU activations of ``glu_gemm`` (its ``ACTIVATION``; swiglu_oai is ``SWIGLU_OAI``)
ACTIVATIONS = {"silu": 0, "swiglu_oai": 0, "gelu": 1, "gelu_tanh": 2, "silu_clamped": 3}

#: The entries a plan runs (``LayerInfo.entry``)
ENTRY_KINDS = ("layer", "monolithic", "modular", "shared")

#: LayerSpec weight field -> role in the plan (and the order of the plan's parameters)
_ROLES = (("router_weight", "router_weight"), ("router_bias", "router_bias"), ("w13", "values"),
          ("w13_scale", "scales"), ("w13_bias", "bias"), ("w2", "values"), ("w2_scale", "scales"), ("w2_bias", "bias"),
          ("expert_map", "expert_map"), ("shared_w13", "values"), ("shared_w13_scale", "scales"),
          ("shared_w2", "values"), ("shared_w2_scale", "scales"), ("shared_gate_weight", "shared_gate"),
          ("score_bias", "score_bias"))


def kernel_layout(name: str) -> Layout:
    """The layout called ``name`` (``mxmoe.core.layouts``), if the GEMMs read it; PlanError otherwise."""
    try:
        layout = get_layout(name)
    except ValueError:
        layout = None
    if layout not in KERNEL_LAYOUTS:
        raise PlanError(f"weight layout {name!r} is not one the Triton kernels read "
                        f"(known: {', '.join(lay.name for lay in KERNEL_LAYOUTS)})")
    return layout


def plan_layer(spec: LayerSpec, arch: int, target: str | None = None, *, deterministic: bool = False,
               batch_invariant: bool = False, activations: str = "bf16") -> KernelPlan:
    """The kernel plan of ``spec`` for ``sm_<arch>`` (``target``: the name it records, ``cuda:sm_<arch>`` by
    default). Decode constants assume any scale byte (``WIDE_SCALES``); see :func:`fit_scale_range`.
    ``deterministic`` / ``batch_invariant``: see :class:`~.kernel_plan.PlanOptions` (the second implies the
    first). ``activations="mxfp8"``: the w4a8 GEMMs (``_w4a8_kernels``; row-major weights)."""
    options = PlanOptions(deterministic or batch_invariant, batch_invariant, activations)
    layout = kernel_layout(spec.layout)
    if activations == "mxfp8":
        if layout != ROW_MAJOR:
            raise PlanError(f"activations='mxfp8' reads row-major weights, not the {layout.name} layout")
        if batch_invariant:
            raise PlanError("activations='mxfp8' has no batch-invariant plan (its small token tiles swap the MMA's "
                            "operands)")
        if spec.hidden % 32 or spec.intermediate % 32:
            raise PlanError(f"activations='mxfp8' needs H and I multiples of 32, got {spec.hidden} and "
                            f"{spec.intermediate}")
        unbuilt = [what for what, there in (("router weight on input", spec.weight_on_input),
                                            ("a shared expert", spec.shared_intermediate),
                                            (f"activation {spec.activation!r}", ACTIVATIONS[spec.activation]))
                   if there]
        if unbuilt:
            raise PlanError(f"activations='mxfp8' does not run {', '.join(unbuilt)} yet (the w4a8 GEMMs); compile "
                            "with activations='bf16'")
    elif activations != "bf16":
        raise PlanError(f"activations must be 'bf16' or 'mxfp8', got {activations!r}")
    kernels = _Kernels()
    E, k = (spec.num_experts, spec.top_k) if spec.routed else (1, 1)
    # the Hopper bf16 path's mid class reaches further on layers of many experts (tile_config.PREFILL_ROWS_PER_EXPERT),
    # with the tiled words the upper part of its range on 128-row tiles (MID_WIDE_ROWS_PER_EXPERT) and large tiles
    # from fewer rows per expert (HOPPER_LARGE_ROWS_PER_EXPERT)
    hopper_bf16 = arch == 90 and activations == "bf16"
    tiled = hopper_bf16 and layout.hopper_words
    classes = shape_classes(E, k, PREFILL_ROWS_PER_EXPERT if hopper_bf16 else 0,
                            MID_WIDE_ROWS_PER_EXPERT if tiled else 0,
                            HOPPER_LARGE_ROWS_PER_EXPERT if tiled else LARGE_ROWS_PER_EXPERT)
    first_tokens = dict(zip((name for name, _ in classes), [1] + [t + 1 for _, t in classes[:-1]]))
    tiles = {name: _class_tiles(spec, layout, arch, name, options, first_tokens[name]) for name, _ in classes}
    slot_rows = {name: _slot_rows(spec, tiles[name][1], options) for name, _ in classes}
    # fp32 layers sum into their output unless some class writes slot rows; then every class writes "output"
    output = "output" if spec.dtype != "float32" or any(slot_rows.values()) else "accumulator"
    cast = _cast_kernel(spec, kernels) if output == "output" else None
    shape = tuple(_shape_class(spec, layout, name, max_tokens, tiles[name], slot_rows[name], cast, kernels,
                               arch, options.activations) for name, max_tokens in classes)
    return KernelPlan(target=target or f"cuda:sm_{arch}", arch=arch, layer=spec.info(),
                      input=PlanInput("x", spec.dtype, spec.hidden), parameters=_parameters(spec),
                      buffers=_buffers(spec, kernels.entries, output), kernels=kernels.entries, classes=shape,
                      output=output, options=options, extra_inputs=_extra_inputs(spec))


def _extra_inputs(spec: LayerSpec) -> tuple[PlanInput, ...]:
    """The entry's inputs after x: the engine's router logits (monolithic) or top-k weights and ids (modular)."""
    if spec.entry == "monolithic":
        return (PlanInput("router_logits", "float32" if spec.router_fp32 else spec.dtype, spec.experts_routed),)
    if spec.entry == "modular":
        return (PlanInput("topk_weights", "float32", spec.top_k), PlanInput("topk_ids", "int32", spec.top_k))
    return ()


def _class_tiles(spec: LayerSpec, layout: Layout, arch: int, name: str, options: PlanOptions,
                 first_tokens: int = 1) -> tuple[TileConfig, TileConfig, TileConfig | None, TileConfig | None]:
    """(w13, w2, shared w13, shared w2) tiles of class ``name`` (the routed GEMMs' None in the shared-expert entry,
    the shared ones' without a shared expert; the shared expert's w2 never splits K). Batch-invariant plans reduce
    along K alike in every class (:func:`~.tile_config.batch_invariant_config`). The routed and shared GEMMs of a
    class share BLOCK_M (a class's row tiles); the shared-expert entry runs its expert in the routed GEMMs' place.
    ``first_tokens``: the class's smallest token count (its w2 input rows decide the Hopper prefill launch order,
    ``class_config``'s ``rows_bytes``)."""
    H, I, S = spec.hidden, spec.intermediate, spec.shared_intermediate
    if options.activations == "mxfp8":  # the w4a8 form: routed GEMMs only (plan_layer refuses a shared expert)
        return w4a8_config(name, 2 * I, H, arch), w4a8_config(name, H, I, arch, gemm="combine"), None, None
    hopper = layout.hopper_words
    rows = first_tokens * (spec.top_k * I if spec.routed else S) * numpy_dtype(spec.dtype).itemsize
    c13 = c2 = s13 = s2 = None
    if spec.routed:
        c13 = class_config(name, 2 * I, H, arch, hopper=hopper, rows_bytes=rows)
        c2 = class_config(name, H, I, arch, gemm="combine", hopper=hopper, rows_bytes=rows)
    if S:
        s13 = class_config(name, 2 * S, H, arch, hopper=hopper, rows_bytes=rows)
        s2 = dataclasses.replace(class_config(name, H, S, arch, gemm="combine", hopper=hopper, rows_bytes=rows),
                                 SPLIT_K=1)
    if options.batch_invariant:
        c13, c2, s13, s2 = (None if c is None else batch_invariant_config(c, K)
                            for c, K in ((c13, H), (c2, I), (s13, H), (s2, S)))
    return c13, c2, s13, s2


def _slot_rows(spec: LayerSpec, c2: TileConfig | None, options: PlanOptions) -> bool:
    """Whether a class combines through slot rows (``SLOT_ROWS``): in deterministic plans, where fp32 atomics
    would add more than twice into an output element (k slots times the w2 GEMM's K splits, and the shared expert):
    two adds from 0 give the same bits in either order."""
    adds = (spec.top_k * c2.SPLIT_K if c2 is not None else 0) + (1 if spec.shared_intermediate else 0)
    return options.deterministic and adds > 2


def fit_scale_range(plan: KernelPlan, scales: Mapping[str, Any]) -> KernelPlan:
    """Let the Hopper decode multiply once per value pair (``WIDE_SCALES=False``) when every scale byte
    of the layer is <= 128 (the factor 2^126 * 2^(s-127) is then a finite bf16); ``scales`` maps the
    plan's scale parameters to their stored arrays (numpy or torch). A layer with a larger scale (weights past
    +-12) or a NaN scale (255) keeps the two-multiply decode, which is exact for every scale. The executor
    refuses weights that break the promise."""
    names = [g for g, p in plan.parameters.items() if p.role == "scales"]
    wide = any(_largest(scales[g]) > HOPPER_MAX_FAST_SCALE for g in names)
    return plan.replace_constexprs({name: {"WIDE_SCALES": wide} for name, spec in plan.kernels.items()
                                    if spec.constexprs.get("W_HOPPER")})


def _largest(a) -> int:
    """The largest value of a numpy array or torch tensor (0 when empty)."""
    return int(a.max()) if (a.numel() if hasattr(a, "numel") else a.size) else 0


def few_token_group_chunk(max_pairs: int, experts_pow2: int) -> int:
    """(token, slot) pairs per step where one program sorts all pairs inside ``router_route_group``: the
    class's largest pair count, at most 4096 one-hot entries a step. Each step is a [CHUNK, experts] one-hot
    with a column scan, so a chunk far past the pairs there are is wasted work on the launch's critical path:
    on the H100 the gemv-class router launch (gpt-oss-20b, 1 token, 128-wide H steps) took 8.0 us at CHUNK 256
    and 4.9 at 16 (120b, 8 warps: 9.4 at 64 and 6.9 at 16); for 5-64 tokens CHUNK 128 (20b) / 32 (120b) were
    the best of 16-256 at 8, 16, 33 and 64 tokens (20b 9.9 -> 6.6 us at 8 tokens, 120b 18.5 -> 10.1, counting
    the 128-wide H steps too)."""
    return max(16, min(_pow2(max_pairs), 4096 // experts_pow2))


def few_token_scatter(max_tokens: int, experts_pow2: int, top_k: int) -> bool:
    """Whether a few-token class's router launch groups from per-block counts (``router_route_scatter``)
    rather than sorting all pairs in the last block routed (``router_route_group``): the decode class with
    128+ experts, or where sorting its largest batch walks FEW_TOKEN_SCATTER_ONE_HOT or more one-hot entries
    (pairs x experts). H100, 2026-11-24 ~18:45 (router launch, CUPTI; forwards in two interleaved rounds): for
    gpt-oss-120b at 64 tokens the launch took 10.0 instead of 23.1 us (forward 581 -> 567 us uniform,
    350 -> 338 skewed; 33 tokens 2-3% faster, 8 tokens 9.5 -> 8.5 us); for gpt-oss-20b (32 experts, whose
    [128, 32] sort steps are cheap) the forward was level at 33-64 tokens and ~1 us slower at 8-17 (the
    counts' global round trips), and at 1-4 tokens (one block of at most 16 pairs) sorting is cheaper for
    both models (120b: 6.9 vs 7.1 us). 64 experts with top-8 (E,k,H,I = 64,8,2048,1024, H200, 2026-11-29): at 64
    tokens 10.6 instead of 21.5 us (forward 110 -> 98 us uniform, 124 -> 111 skewed), level at 8 tokens."""
    return max_tokens > GEMV_MAX_TOKENS and (experts_pow2 >= 128
                                            or max_tokens * top_k * experts_pow2 >= FEW_TOKEN_SCATTER_ONE_HOT)


# ------------------------------------------------------------------------------------ the pieces
def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _Kernels:
    """The plan's kernel entries in the order they are added. An entry equal to one already there is not added
    again: classes whose tiles coincide share one kernel (one cubin)."""

    def __init__(self):
        self.entries: dict[str, KernelSpec] = {}

    def add(self, entry: str, kernel: str, args, constexprs: dict, num_warps: int, num_stages: int) -> str:
        spec = KernelSpec(kernel, constexprs, num_warps, num_stages, tuple(args))
        for name, existing in self.entries.items():
            if existing == spec:
                return name
        base, n = entry, 2
        while entry in self.entries:  # the same name for another kernel (e.g. the shared expert's tiles)
            entry, n = f"{base}.{n}", n + 1
        self.entries[entry] = spec
        return entry


def _parameters(spec: LayerSpec) -> dict[str, Parameter]:
    """Every stored weight the kernels read, by name, with its role and the layer operand it holds."""
    out = {}
    for operand, role in _ROLES:
        weight = getattr(spec, operand)
        if weight is not None:
            if operand in ("shared_w13", "shared_w2") and not spec.mxfp4_shared:
                role = "dense"  # in the activation dtype, read as stored
            out[weight.name] = Parameter(role, operand, tuple(weight.shape), weight.dtype)
    return out


def _weight(name: str, weight: StoredWeight | None, dtype: str = "float32") -> Arg:
    """A kernel's pointer to a weight, or a dummy pointer for an absent one."""
    return Arg.param(name, weight.name) if weight is not None else Arg.none(name, dtype)


def _buffers(spec: LayerSpec, kernels: Mapping[str, KernelSpec], output: str) -> dict[str, Buffer]:
    """The scratch of one call, as far as a kernel or the output uses it (e.g. no block counts without a
    scatter). Sizes are expressions of T and the class vars (NB / NBS row blocks of the routed / shared expert, RS
    router splits, NC chunks, ACC accumulator rows, SR / SP slot rows / fp32 partial slot rows, SHR the shared
    expert's rows: 0 in a class that has no use for them)."""
    E, k, H, I, S = spec.num_experts, spec.top_k, spec.hidden, spec.intermediate, spec.shared_intermediate
    experts_pow2 = _pow2(E)
    # the sm_90 w4a8 form pads its activation rows to whole K steps (one step for all classes: one quantizer)
    hopper_k = {e.constexprs.get("HOPPER_K", 0) for e in kernels.values() if e.kernel == "mxfp8_quant"} or {0}
    if len(hopper_k) > 1:
        raise PlanError(f"the sm_90 w4a8 GEMMs of one plan must share their K step, got {sorted(hopper_k)}")
    step = hopper_k.pop() or 1
    buffers = {
        "router_partials": Buffer("float32", ("RS", "T", max(16, _pow2(spec.experts_routed)))),
        "routing_weights": Buffer("float32", ("T", k)),
        "expert_ids": Buffer("int32", ("T", k)),
        "sorted_pairs": Buffer("int32", (f"T * {k}",)),
        "chunk_counts": Buffer("int32", ("NC", experts_pow2)),
        "chunk_offsets": Buffer("int32", ("NC", experts_pow2)),
        "expert_offsets": Buffer("int32", (E + 1,)),
        "block_expert": Buffer("int32", ("NB",)),
        "block_start": Buffer("int32", ("NB",)),
        "activations": Buffer("bfloat16", (f"T * {k}", I)),
        # the w4a8 form: the hidden states and the GLU output as MXFP8 (e4m3 bytes, scale bytes)
        "x_q": Buffer("uint8", ("T", -(-H // step) * step)),
        "x_scales": Buffer("uint8", ("T", H // 32)),
        "activations_q": Buffer("uint8", (f"T * {k}", -(-I // step) * step)),
        "activations_scales": Buffer("uint8", (f"T * {k}", I // 32)),
        "glu_output": Buffer(spec.dtype, (f"T * {k}", I)),
        # the few-token classes' router counts its programs here (router_route_group / _scatter)
        "route_counter": Buffer("int32", (f"cdiv(T, {FEW_TOKEN_ROUTER_BLOCK}) + 1",), "zeros", left_zero=True),
        # ... and with router_route_scatter each routed token block counts its pairs per expert, with their
        # ranks in the block
        "block_pair_counts": Buffer("int32", (f"cdiv(T, {FEW_TOKEN_ROUTER_BLOCK})", experts_pow2)),
        "pair_ranks": Buffer("int32", (f"T * {k}",)),
        # the combine's fp32 sums; the gemv class fuses the cast into the combine, which counts its programs per
        # column tile in an extra row (zeroed with the sums); see combine_gemm_kernel. The cast clears what it
        # read, unless the sums are the layer's output (fp32 layers without slot rows)
        "accumulator": Buffer("float32", ("ACC", H), "zeros", left_zero=output != "accumulator"),
        # deterministic combines: each (token, slot)'s expert output, [SPLIT_K, T*k, H] (fp32 partials if split)
        "slot_rows": Buffer(spec.dtype, ("SR", H)),
        "slot_partials": Buffer("float32", ("SP", H)),
        # the shared expert: every token on its one expert (dense groups), its gate, its GLU output, its rows
        "shared_pairs": Buffer("int32", ("T",)),
        "shared_offsets": Buffer("int32", (2,)),
        "shared_block_expert": Buffer("int32", ("NBS",)),
        "shared_block_start": Buffer("int32", ("NBS",)),
        "shared_weights": Buffer("float32", ("T",)),
        "shared_activations": Buffer("bfloat16", ("T", max(S, 1))),
        "shared_dense_act": Buffer(spec.dtype, ("T", max(S, 1))),
        "shared_rows": Buffer(spec.dtype, ("SHR", H)),
        "output": Buffer(spec.dtype, ("T", H)),
    }
    used = {a.ref for entry in kernels.values() for a in entry.args if a.bind == "buffer"} | {output}
    return {name: b for name, b in buffers.items() if name in used}


#: the grouping's result as the GEMMs (and the fused router launch) take it
_GROUPS = (Arg.buffer("sorted_pairs_ptr", "sorted_pairs"), Arg.buffer("expert_offsets_ptr", "expert_offsets"),
           Arg.buffer("block_expert_ptr", "block_expert"), Arg.buffer("block_start_ptr", "block_start"))
#: ... and the shared expert's (every token on its expert 0)
_SHARED_GROUPS = (Arg.buffer("sorted_pairs_ptr", "shared_pairs"), Arg.buffer("expert_offsets_ptr", "shared_offsets"),
                  Arg.buffer("block_expert_ptr", "shared_block_expert"),
                  Arg.buffer("block_start_ptr", "shared_block_start"))


def _routing_weights(spec: LayerSpec, name: str) -> Arg:
    """Where the kernels read the routing weights: the routing's buffer, or the modular entry's input."""
    return Arg.input(name, "topk_weights") if spec.entry == "modular" else Arg.buffer(name, "routing_weights")


def _cast_kernel(spec: LayerSpec, kernels: _Kernels) -> str:
    """The fp32 accumulator -> output copy (in the output dtype): the combine needs fp32 for its atomics."""
    return kernels.add("cast", "cast", [
        Arg.buffer("src_ptr", "accumulator"), Arg.buffer("dst_ptr", "output"),
        Arg.scalar("numel", f"T * {spec.hidden}", "i64")], {"BLOCK": CAST_BLOCK}, 4, 1)


def _shape_class(spec: LayerSpec, layout: Layout, name: str, max_tokens: int | None,
                 tiles: tuple, slot_rows: bool, cast: str | None, kernels: _Kernels, arch: int = 90,
                 activations: str = "bf16") -> ShapeClass:
    """One token-count class: its tiles (:func:`_class_tiles`; BLOCK_M is the class's, shared by both GEMMs, which
    read one block map), then routing, grouping, the shared expert's GEMMs, the routed GEMMs and the cast (or the
    deterministic combine), in launch order."""
    E, k, H = spec.num_experts, spec.top_k, spec.hidden
    c13, c2, s13, s2 = tiles
    shared = s13 is not None
    launches, split, routed_tiles = [], 1, {}
    fuse_cast = spec.routed and cast is not None and fused_cast(max_tokens)  # gemv: the combine's last program
    splits = 0
    if spec.routed:
        bm = c13.BLOCK_M
        routing, splits = _routing_launches(spec, name, max_tokens, bm, kernels)
        launches += routing
        split = c2.SPLIT_K
        routed_tiles = {"w13": dataclasses.asdict(c13), "w2": dataclasses.asdict(c2)}
    if shared:
        launches += _shared_expert(spec, layout, name, s13, s2, slot_rows, kernels)
    if spec.routed and activations == "mxfp8":
        launches += [_quantize("x", "x", "T", spec.hidden, arch, c13.BLOCK_K, kernels),
                     _glu_gemm_w4a8(spec, arch, name, c13, kernels)]
        if arch < 100:
            launches.append(_quantize("glu_output", "activations", f"T * {k}", spec.intermediate, arch, c2.BLOCK_K,
                                      kernels))
        launches.append(_combine_gemm_w4a8(spec, arch, name, c2, fuse_cast, slot_rows, kernels))
    elif spec.routed:
        launches.append(_glu_gemm(spec, layout, name, c13, kernels))
        launches.append(_combine_gemm(spec, layout, name, c2, fuse_cast, slot_rows, kernels))
    if slot_rows and not fuse_cast:
        launches.append(_combine_slots(spec, split, kernels))
    elif cast is not None and not fuse_cast:
        launches.append(Launch(cast, (f"cdiv(T * {H}, {CAST_BLOCK})",)))
    pairs = f"T * {k}"
    acc_rows = "T + 1" if fuse_cast else "0" if slot_rows else "T"
    tile_info = dict(routed_tiles)
    if shared:
        tile_info.update(shared_w13=dataclasses.asdict(s13), shared_w2=dataclasses.asdict(s2))
    chunk = group_chunk(E, None if max_tokens is None else max_tokens * k)
    # NB: an upper bound on sum_e cdiv(count_e, BLOCK_M): each non-empty expert adds at most one partial block,
    # and at most min(E, T*k) experts are non-empty
    return ShapeClass(name, max_tokens, {
        "NB": f"{pairs} // {c13.BLOCK_M} + min({E}, {pairs})" if spec.routed else "0",
        "NBS": f"cdiv(T, {s13.BLOCK_M})" if shared else "0", "RS": splits, "NC": f"cdiv({pairs}, {chunk})",
        "ACC": acc_rows, "SR": pairs if slot_rows and split == 1 and spec.routed else "0",
        "SP": f"{split} * {pairs}" if slot_rows and split > 1 else "0",
        "SHR": "T" if slot_rows and shared else "0"}, tile_info, tuple(launches))


def _routing_launches(spec: LayerSpec, cls: str, max_tokens: int | None, bm: int,
                      kernels: _Kernels) -> tuple[list[Launch], int]:
    """(launches, splits of H) that leave the routing weights, the (local) expert ids and their groups: the layer
    entry's router (:func:`_router_launches`), the monolithic entry's routing of the engine's logits, the modular
    entry's mapping of the engine's ids; grouping inside the launch for few tokens, in launches of its own for
    many (:func:`_grouping_launches`)."""
    few = is_few_tokens(max_tokens)
    if spec.entry == "modular":
        routing = [_map_ids(spec, cls, max_tokens, bm, kernels)]
        splits = 0
    else:
        routing, splits = _router_launches(spec, cls, max_tokens, bm, kernels)
    grouping = [] if few else _grouping_launches(spec, cls, max_tokens, bm, kernels)
    return routing + grouping, splits


def _map_ids(spec: LayerSpec, cls: str, max_tokens: int | None, bm: int, kernels: _Kernels) -> Launch:
    """The modular entry: the engine's global ids -> this layer's (or -1: ``map_ids``); for few tokens the same
    program groups them (``map_and_group``)."""
    k, E = spec.top_k, spec.num_experts
    args = [Arg.input("ids_ptr", "topk_ids"), _weight("map_ptr", spec.expert_map, "int32"),
            Arg.buffer("out_ptr", "expert_ids")]
    consts = dict(NUM_GLOBAL=spec.experts_routed, HAS_MAP=spec.expert_map is not None)
    if is_few_tokens(max_tokens):
        entry = kernels.add(f"map_and_group.{cls}", "map_and_group", args + [
            *_GROUPS, Arg.scalar("num_pairs", f"T * {k}"), Arg.scalar("num_blocks", "NB")],
            {**consts, "NUM_EXPERTS": E, "EXPERTS_POW2": _pow2(E), "BLOCK_M": bm,
             "CHUNK": few_token_group_chunk(max_tokens * k, _pow2(E))}, 8 if _pow2(E) >= 128 else 4, 1)
        return Launch(entry, (1,))
    entry = kernels.add("map_ids", "map_ids", args + [Arg.scalar("num_pairs", f"T * {k}")],
                        {**consts, "BLOCK": MAP_BLOCK}, 4, 1)
    return Launch(entry, (f"cdiv(T * {k}, {MAP_BLOCK})",))


def _shared_expert(spec: LayerSpec, layout: Layout, cls: str, s13: TileConfig, s2: TileConfig, slot_rows: bool,
                   kernels: _Kernels) -> list[Launch]:
    """The shared expert as one more grouped expert: its gate (``shared_gate``), its groups (every token on
    expert 0: ``dense_groups``), then the grouped GEMMs on its weights (gate rows then up rows: the concatenated
    order), adding into the same accumulator with weight 1 or its gate (or, in slot-row classes, its own rows)."""
    H, S = spec.hidden, spec.shared_intermediate
    launches = []
    if spec.shared_gate:
        entry = kernels.add("shared_gate", "shared_gate", [
            Arg.input("x_ptr"), Arg.param("w_ptr", spec.shared_gate_weight.name),
            Arg.buffer("out_ptr", "shared_weights"), Arg.scalar("num_tokens", "T")],
            dict(HIDDEN=H, BLOCK_T=16, BLOCK_H=min(256, max(16, _pow2(H))), ROUND_BF16=spec.dtype == "bfloat16"), 4, 1)
        launches.append(Launch(entry, ("cdiv(T, 16)",)))
    if not spec.mxfp4_shared:
        return launches + _dense_shared(spec, cls, s13, slot_rows, kernels)
    entry = kernels.add(f"dense_groups.{s13.BLOCK_M}", "dense_groups", [
        *_SHARED_GROUPS, Arg.scalar("num_tokens", "T"), Arg.scalar("num_blocks", "NBS")],
        dict(BLOCK_M=s13.BLOCK_M, BLOCK=1024), 4, 1)
    launches.append(Launch(entry, ("cdiv(T, 1024)",)))
    one = dataclasses.replace(spec, num_experts=1, top_k=1, intermediate=S, interleaved=False, w13_bias=None,
                              w2_bias=None, w13=spec.shared_w13, w13_scale=spec.shared_w13_scale, w2=spec.shared_w2,
                              w2_scale=spec.shared_w2_scale, weight_on_input=False, entry="shared")
    launches.append(_glu_gemm(one, layout, cls, s13, kernels, groups=_SHARED_GROUPS, act="shared_activations",
                              entry_name=f"shared_glu_gemm.{cls}"))
    weights = Arg.buffer("routing_weights_ptr", "shared_weights") if spec.shared_gate else \
        Arg.none("routing_weights_ptr")
    launches.append(_combine_gemm(one, layout, cls, s2, False, False, kernels, groups=_SHARED_GROUPS,
                                  act="shared_activations", weights=weights, unit_weights=not spec.shared_gate,
                                  rows_to="shared_rows" if slot_rows else None, entry_name=f"shared_combine_gemm.{cls}"))
    return launches


#: tiles of the dense shared expert's GEMMs (``dense_glu`` / ``dense_out``): BLOCK_M the class's, at most 64.
#: BLOCK_K is the same in every class (the sums' order, so batch invariance, does not depend on the token count);
#: classes of 16-row tiles (few tokens) take narrow column tiles and a deeper pipeline: the weights are the
#: traffic, and 64 columns gave a qwen1.5-moe-sized expert (I = 5632) fewer programs than the H100 has SMs
DENSE_BLOCK_N, DENSE_BLOCK_K = 64, 64
DENSE_FEW_TOKENS_BLOCK_N, DENSE_FEW_TOKENS_STAGES = 16, 4


def _dense_shared(spec: LayerSpec, cls: str, s13: TileConfig, slot_rows: bool, kernels: _Kernels) -> list[Launch]:
    """A shared expert in the activation dtype (bf16 weights): ``dense_glu`` (x @ w13^T, its GLU) then
    ``dense_out`` (@ w2^T, times the gate), rounded as the reference's linear layers round, added into the
    accumulator, or (slot-row classes) written to the shared rows the deterministic combine adds with weight 1."""
    H, S = spec.hidden, spec.shared_intermediate
    bm = min(64, max(16, s13.BLOCK_M))
    bn, stages = (DENSE_FEW_TOKENS_BLOCK_N, DENSE_FEW_TOKENS_STAGES) if bm == 16 else (DENSE_BLOCK_N, 2)
    common = dict(IEEE_FP32=spec.dtype == "float32", ROUND_BF16=spec.dtype == "bfloat16", BLOCK_M=bm,
                  BLOCK_N=bn, BLOCK_K=DENSE_BLOCK_K)
    glu = kernels.add(f"dense_glu.{bm}", "dense_glu", [
        Arg.input("x_ptr"), Arg.param("w_ptr", spec.shared_w13.name), Arg.buffer("act_ptr", "shared_dense_act"),
        Arg.scalar("num_tokens", "T")],
        dict(HIDDEN=H, INTERMEDIATE=S, SWIGLU_OAI=spec.activation == "swiglu_oai",
             ACTIVATION=ACTIVATIONS[spec.activation], ALPHA=spec.alpha, LIMIT=spec.limit, **common), 4, stages)
    gate = Arg.buffer("gate_ptr", "shared_weights") if spec.shared_gate else Arg.none("gate_ptr")
    out = kernels.add(f"dense_out.{bm}", "dense_out", [
        Arg.buffer("a_ptr", "shared_dense_act"), Arg.param("w_ptr", spec.shared_w2.name), gate,
        Arg.buffer("out_ptr", "shared_rows" if slot_rows else "accumulator"), Arg.scalar("num_tokens", "T")],
        dict(HIDDEN=H, INTERMEDIATE=S, GATED=spec.shared_gate, ADD=not slot_rows, **common), 4, stages)
    return [Launch(glu, (f"cdiv(T, {bm})", f"cdiv({S}, {bn})")),
            Launch(out, (f"cdiv(T, {bm})", f"cdiv({H}, {bn})"))]


def _gated_in_combine(spec: LayerSpec) -> bool:
    """Whether the combine multiplies the shared rows by the gate (MXFP4: yes; bf16: ``dense_out`` did)."""
    return spec.shared_gate and spec.mxfp4_shared


def _combine_slots(spec: LayerSpec, split: int, kernels: _Kernels) -> Launch:
    """The deterministic combine of the slot rows (``combine_slots``), into the output."""
    rows = "slot_rows" if split == 1 else "slot_partials"
    block_h = min(SLOTS_BLOCK_H, max(16, _pow2(spec.hidden)))
    entry = kernels.add(f"combine_slots.{rows}", "combine_slots", [
        Arg.buffer("rows_ptr", rows), _routing_weights(spec, "weights_ptr"), Arg.buffer("ids_ptr", "expert_ids"),
        Arg.buffer("out_ptr", "output"), Arg.scalar("num_tokens", "T"), *_shared_row_args(spec, True)],
        dict(HIDDEN=spec.hidden, TOP_K=spec.top_k, SPLIT_K=split, ROUND_ROWS=split > 1 and spec.dtype == "bfloat16",
             UNIT_WEIGHTS=spec.weight_on_input, BLOCK_T=SLOTS_BLOCK_T, BLOCK_H=block_h,
             SHARED=bool(spec.shared_intermediate), SHARED_GATE=_gated_in_combine(spec)), 4, 1)
    return Launch(entry, (f"cdiv(T, {SLOTS_BLOCK_T})", f"cdiv({spec.hidden}, {block_h})"))


def _shared_row_args(spec: LayerSpec, slot_rows: bool) -> list[Arg]:
    """The shared expert's rows and gate as the deterministic combine reads them (dummies where it does not)."""
    if slot_rows and spec.shared_intermediate:
        gate = Arg.buffer("shared_w_ptr", "shared_weights") if _gated_in_combine(spec) else Arg.none("shared_w_ptr")
        return [Arg.buffer("shared_rows_ptr", "shared_rows"), gate]
    return [Arg.none("shared_rows_ptr", spec.dtype), Arg.none("shared_w_ptr")]


def _router_launches(spec: LayerSpec, cls: str, max_tokens: int | None, bm: int,
                     kernels: _Kernels) -> tuple[list[Launch], int]:
    """(launches, splits of H) of the router and routing for a class: few tokens split the router weight's H
    across programs to stream it at bandwidth, and the same launch routes each token block in its last router
    program and groups all pairs in the last block routed (:func:`_few_token_router`); a few hundred tokens
    write the same split sums to memory and route them in a second launch (:func:`_split_router`); many tokens
    route in one launch whose programs walk all of H (:func:`_router_route`); both group in launches of their own
    (:func:`_grouping_launches`). All compute a token's logits alike (the routing contract). The monolithic
    entry routes the engine's logits with the same launches, without their router."""
    if is_few_tokens(max_tokens):
        return _few_token_router(spec, cls, max_tokens, bm, kernels)
    if max_tokens is not None and max_tokens <= SPLIT_ROUTER_MAX_TOKENS:
        return _split_router(spec, cls, kernels)
    return [_router_route(spec, cls, kernels)], 0


def _split_router(spec: LayerSpec, cls: str, kernels: _Kernels) -> tuple[list[Launch], int]:
    """Router and routing of a few hundred tokens in two launches: ``router_gemm`` (a program per 16-token block
    and FEW_TOKEN_ROUTER_H-wide slice of H, fp32 partial sums to memory) then ``route_partials`` (the sums added
    in slice order, top-k): the few-token router's computation without its in-launch routing and grouping, so a
    token's logits are the same bits as in every other class (docs/routing.md)."""
    H, block_t = spec.hidden, FEW_TOKEN_ROUTER_BLOCK
    logits_in = spec.entry == "monolithic"  # the engine's logits: no router GEMM
    h_per_split = min(H, FEW_TOKEN_ROUTER_H)
    splits = 1 if logits_in else -(-H // h_per_split)
    launches = []
    if not logits_in:
        router_consts = _router_constexprs(spec, block_t, h_per_split, max(16, _pow2(h_per_split)))
        warps = 8 if router_consts["EXPERTS_POW2"] >= 128 else 4
        gemm = kernels.add(f"router_gemm.{cls}", "router_gemm", _router_args(spec), router_consts, warps, 2)
        launches.append(Launch(gemm, (f"cdiv(T, {block_t})", "RS")))
    route_consts = {**_route_constexprs(spec, splits), **_routing_extras(spec)}
    if spec.expert_map is not None or logits_in:
        route_consts.update(HAS_MAP=spec.expert_map is not None, LOGITS_IN=logits_in)
    route = kernels.add(f"route_partials.{cls}", "route_partials", [
        Arg.input("partial_ptr", "router_logits") if logits_in else Arg.buffer("partial_ptr", "router_partials"),
        _weight("b_ptr", spec.router_bias), Arg.buffer("weights_ptr", "routing_weights"),
        Arg.buffer("ids_ptr", "expert_ids"), Arg.scalar("num_tokens", "T"),
        _weight("map_ptr", spec.expert_map, "int32"), _weight("sb_ptr", spec.score_bias)], route_consts, 4, 1)
    launches.append(Launch(route, (f"cdiv(T, {route_consts['BLOCK_T']})",)))
    return launches, 0 if logits_in else splits


def router_sub_blocks(experts_pow2: int) -> int:
    """16-token blocks per program of the many-token router (``router_route``), sharing each weight chunk it
    loads: 4 up to 64 experts, 2 up to 128, else 1 (the sub-blocks' fp32 sums stay in registers)."""
    return 4 if experts_pow2 <= 64 else 2 if experts_pow2 <= 128 else 1


def _router_route(spec: LayerSpec, cls: str, kernels: _Kernels) -> Launch:
    """Router and routing of many tokens in one launch (``router_route``): the same chunks of H, the same dot per
    16-token tile and the same order of the chunk sums as the few-token router, so a token's routing never
    depends on its batch (issue #22; docs/routing.md)."""
    H, block_t = spec.hidden, FEW_TOKEN_ROUTER_BLOCK
    h_per_split = min(H, FEW_TOKEN_ROUTER_H)
    router_consts = _router_constexprs(spec, block_t, h_per_split, max(16, _pow2(h_per_split)))
    sub = router_sub_blocks(router_consts["EXPERTS_POW2"])
    route_consts = _route_constexprs(spec, 1)
    consts = {k: router_consts[k] for k in ("HIDDEN", "NUM_EXPERTS", "EXPERTS_POW2", "H_PER_SPLIT", "IEEE_FP32",
                                            "BLOCK_H")}
    consts.update(ROUTER_BLOCK_T=block_t, SUB_BLOCKS=sub,
                  **{k: route_consts[k] for k in ("TOP_K", "SLOTS_POW2", "HAS_BIAS", "ROUND_LOGITS_BF16",
                                                  "SOFTMAX_OVER_ALL")}, HAS_MAP=spec.expert_map is not None,
                  **_routing_extras(spec))
    logits_in = spec.entry == "monolithic"
    if logits_in:
        consts["LOGITS_IN"] = True
    warps = 8 if router_consts["EXPERTS_POW2"] >= 128 else 4
    entry = kernels.add(f"router_route.{cls}", "router_route", [
        Arg.input("x_ptr", "router_logits") if logits_in else Arg.input("x_ptr"), _router_weight_arg(spec),
        _weight("b_ptr", spec.router_bias), Arg.buffer("weights_ptr", "routing_weights"),
        Arg.buffer("ids_ptr", "expert_ids"), _weight("map_ptr", spec.expert_map, "int32"),
        Arg.scalar("num_tokens", "T"), _weight("sb_ptr", spec.score_bias)], consts, warps, 2)
    return Launch(entry, (f"cdiv(T, {block_t * sub})",))


def _router_weight_arg(spec: LayerSpec) -> Arg:
    return _weight("w_ptr", spec.router_weight, spec.dtype)


def _few_token_router(spec: LayerSpec, cls: str, max_tokens: int, bm: int,
                      kernels: _Kernels) -> tuple[list[Launch], int]:
    """Router, routing and grouping of 1-64 tokens in one launch (``router_route_group``, or with 128+ experts
    in the decode class ``router_route_scatter``: :func:`few_token_scatter`). Each program loads its
    FEW_TOKEN_ROUTER_H-wide slice of H in one step; 8 warps for 128+ experts in the decode class (the routing
    program's [16, 128] top-k and the one-hot grouping): gpt-oss-120b at 8 tokens 17.0 -> 10.8 us on the H100; on the
    H200 (2026-11-29) 4 warps there were 0.5-7% slower at 8-64 tokens (gpt-oss-120b, E,k,H,I = 128,8,2048,768). The
    gemv class's [4, 128] tiles take 4: its launch 7.1 -> 6.3 us (gpt-oss-120b) and 8.3 -> 7.6 (128,8,2048,768), the
    forward 3% faster at 1 token, 1-1.5% at 4. The monolithic entry:
    one program per token block routes the engine's logits (LOGITS_IN), no router."""
    H, k, block_t = spec.hidden, spec.top_k, FEW_TOKEN_ROUTER_BLOCK
    logits_in = spec.entry == "monolithic"
    h_per_split = min(H, FEW_TOKEN_ROUTER_H)
    splits = 1 if logits_in else -(-H // h_per_split)
    experts_pow2 = _pow2(spec.num_experts)  # the layer's own experts, which the grouping counts
    router_consts = _router_constexprs(spec, block_t, h_per_split, max(16, _pow2(h_per_split)))
    args = ([Arg.none("x_ptr", spec.dtype), Arg.none("w_ptr", spec.dtype),
             Arg.input("partial_ptr", "router_logits"), Arg.scalar("num_tokens", "T")] if logits_in
            else _router_args(spec)) + [
        _weight("b_ptr", spec.router_bias), Arg.buffer("weights_ptr", "routing_weights"),
        Arg.buffer("ids_ptr", "expert_ids"), *_GROUPS, Arg.scalar("num_blocks", "NB"),
        Arg.buffer("counter_ptr", "route_counter")]
    consts = {**router_consts, **_route_constexprs(spec, splits), "ROUTER_BLOCK_T": block_t,
              "BLOCK_T": min(_pow2(max_tokens), block_t), "GROUP_EXPERTS_POW2": experts_pow2, "BLOCK_M": bm}
    extra = _routing_extras(spec)
    more = [_weight("map_ptr", spec.expert_map, "int32"), _weight("sb_ptr", spec.score_bias)]
    if spec.num_experts != spec.experts_routed or spec.expert_map is not None or logits_in:
        extra.update(GROUP_EXPERTS=spec.num_experts, HAS_MAP=spec.expert_map is not None, LOGITS_IN=logits_in)
    warps = 8 if router_consts["EXPERTS_POW2"] >= 128 and max_tokens > GEMV_MAX_TOKENS else 4
    if few_token_scatter(max_tokens, experts_pow2, k):
        fused = kernels.add(f"router_route_scatter.{cls}", "router_route_scatter", args + [
            Arg.buffer("block_counts_ptr", "block_pair_counts"), Arg.buffer("ranks_ptr", "pair_ranks")] + more,
            {**consts, "TOKEN_BLOCKS_POW2": _pow2(-(-max_tokens // block_t)),
             "LANES": min(1024, _pow2(max_tokens * k)), **extra}, warps, 2)
    else:
        fused = kernels.add(f"router_route_group.{cls}", "router_route_group", args + more,
                            {**consts, "CHUNK": few_token_group_chunk(max_tokens * k, experts_pow2), **extra}, warps, 2)
    return [Launch(fused, (f"cdiv(T, {block_t})", "RS" if not logits_in else 1))], 0 if logits_in else splits


def _router_args(spec: LayerSpec) -> list[Arg]:
    return [Arg.input("x_ptr"), _router_weight_arg(spec), Arg.buffer("partial_ptr", "router_partials"),
            Arg.scalar("num_tokens", "T")]


def _router_constexprs(spec: LayerSpec, block_t: int, h_per_split: int, block_h: int) -> dict[str, Any]:
    """The router GEMM's constants: fp32 partial sums of BLOCK_T tokens over H_PER_SPLIT of H, in BLOCK_H steps
    (a tl.dot needs N >= 16 experts), over the experts routed (all of them, under expert parallelism)."""
    E = spec.experts_routed
    return dict(HIDDEN=spec.hidden, NUM_EXPERTS=E, EXPERTS_POW2=max(16, _pow2(E)),
                H_PER_SPLIT=h_per_split, IEEE_FP32=spec.dtype == "float32" or spec.router_fp32, BLOCK_T=block_t,
                BLOCK_H=block_h)


def _route_constexprs(spec: LayerSpec, splits: int) -> dict[str, Any]:
    """The routing's constants: top-k + softmax of the summed partials, logits rounded to bf16 for bf16 layers
    (the contract: docs/routing.md), at most ROUTE_BLOCK_T tokens and 4096 logits per program."""
    experts_pow2 = max(16, _pow2(spec.experts_routed))
    return dict(NUM_EXPERTS=spec.experts_routed, TOP_K=spec.top_k, EXPERTS_POW2=experts_pow2,
                SLOTS_POW2=_pow2(spec.top_k), SPLITS=splits, HAS_BIAS=spec.router_bias is not None,
                ROUND_LOGITS_BF16=spec.dtype == "bfloat16" and not spec.router_fp32,
                BLOCK_T=max(1, min(ROUTE_BLOCK_T, 4096 // experts_pow2)),
                SOFTMAX_OVER_ALL=spec.routing == "softmax_topk" and not spec.renormalize)


def _routing_extras(spec: LayerSpec) -> dict[str, Any]:
    """The routing kernels' constants for the sigmoid routers, expert groups, a correction bias and scaling (the
    defaults, left out, are the softmax routings: plans of those layers stay as they were)."""
    extras: dict[str, Any] = {}
    if ROUTINGS[spec.routing]:
        extras.update(SIGMOID=ROUTINGS[spec.routing], RENORMALIZE=spec.renormalize)
    if spec.score_bias is not None:
        extras["HAS_SCORE_BIAS"] = True
    if spec.n_group > 1 and spec.topk_group < spec.n_group:
        extras.update(N_GROUP=spec.n_group, TOPK_GROUP=spec.topk_group, GROUPS_POW2=_pow2(spec.n_group))
    if spec.scaling != 1.0:
        extras["SCALING"] = float(spec.scaling)
    return extras


def _group_sub(num_experts: int) -> int:
    """Pairs per step of the parallel grouping kernels: their [SUB, E] one-hot tiles stay at 8192 elements."""
    return max(16, min(256, 8192 // _pow2(num_experts)))


def group_chunk(num_experts: int, max_pairs: int | None) -> int:
    """Pairs per program of the parallel grouping kernels for a class of at most ``max_pairs`` (token, slot) pairs
    (None: unbounded): one step of :func:`_group_sub` pairs, doubled while the class's largest batch would run more
    than GROUP_PROGRAMS programs, up to GROUP_CHUNK. A program's steps run one after another (a running count per
    expert), so a few long programs were what the grouping cost at a few thousand pairs: H200, 2026-11-28,
    CUPTI, 512 tokens, chunks of 1024 pairs (2 programs): gpt-oss-120b histogram 18.0 us and scatter 29.4 us,
    gpt-oss-20b 3.0 and 8.8 (docs/nvidia.md)."""
    sub = _group_sub(num_experts)
    chunk = sub
    while chunk < GROUP_CHUNK and (max_pairs is None or max_pairs > chunk * GROUP_PROGRAMS):
        chunk *= 2
    return chunk


def _grouping_launches(spec: LayerSpec, cls: str, max_tokens: int | None, bm: int,
                       kernels: _Kernels) -> list[Launch]:
    """Many pairs: per-chunk histograms, one scan, a parallel scatter; the same stable order and block map as
    the one-program sort (at 16384 tokens of gpt-oss-20b 965 us -> ~20 us each on the H100). Pairs whose id is
    -1 (not this layer's expert) are in no group. Chunks of :func:`group_chunk` pairs."""
    E, pairs = spec.num_experts, f"T * {spec.top_k}"
    experts_pow2 = _pow2(E)
    sub = _group_sub(E)
    chunk = group_chunk(E, None if max_tokens is None else max_tokens * spec.top_k)
    hist = kernels.add(f"chunk_histogram.{cls}", "chunk_histogram", [
        Arg.buffer("ids_ptr", "expert_ids"), Arg.buffer("chunk_counts_ptr", "chunk_counts"),
        Arg.scalar("num_pairs", pairs)], dict(EXPERTS_POW2=experts_pow2, CHUNK=chunk, SUB=sub), 4, 1)
    scan = kernels.add(f"chunk_scan.{cls}", "chunk_scan", [
        Arg.buffer("chunk_counts_ptr", "chunk_counts"), Arg.buffer("chunk_offsets_ptr", "chunk_offsets"),
        *_GROUPS[1:], Arg.scalar("num_chunks", "NC"), Arg.scalar("num_blocks", "NB")],
        dict(NUM_EXPERTS=E, EXPERTS_POW2=experts_pow2, BLOCK_M=bm, SUB=sub), 8, 1)
    scatter = kernels.add(f"chunk_scatter.{cls}", "chunk_scatter", [
        Arg.buffer("ids_ptr", "expert_ids"), Arg.buffer("chunk_offsets_ptr", "chunk_offsets"),
        Arg.buffer("sorted_pairs_ptr", "sorted_pairs"), Arg.scalar("num_pairs", pairs)],
        dict(EXPERTS_POW2=experts_pow2, CHUNK=chunk, SUB=sub), 4, 1)
    return [Launch(hist, ("NC",)), Launch(scan, (1,)), Launch(scatter, ("NC",))]


def _tail_tiles(consts: dict, cfg: TileConfig, layout: Layout) -> None:
    """Name TAIL_M among a grouped GEMM's constexprs where its tile asks for it (the Hopper words path only; plans
    without it keep the constexprs they always had)."""
    if cfg.TAIL_M and layout.hopper_words:
        consts["TAIL_M"] = cfg.TAIL_M


def _glu_gemm(spec: LayerSpec, layout: Layout, cls: str, cfg: TileConfig, kernels: _Kernels, *, groups=_GROUPS,
              act: str = "activations", entry_name: str | None = None) -> Launch:
    """The w13 GEMM: x rows gathered by token (times their routing weight: router weight on input), bias and GLU
    in the epilogue, [T*k, I] bf16 out in expert-sorted order; weights decoded in registers (Hopper words) or fed
    to tl.dot_scaled (row-major). K_CONTIGUOUS is always True (format-/1 plans name it; the N-contiguous path is
    gone); WIDE_SCALES starts True (:func:`fit_scale_range` may lower it)."""
    consts = dict(HIDDEN=spec.hidden, INTERMEDIATE=spec.intermediate, TOP_K=spec.top_k,
                  HAS_BIAS=spec.w13_bias is not None, INTERLEAVED=spec.interleaved,
                  SWIGLU_OAI=spec.activation == "swiglu_oai", ALPHA=spec.alpha, LIMIT=spec.limit, K_CONTIGUOUS=True,
                  BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                  W_TMA=use_tma(cfg, spec.interleaved, layout.tiles), NUM_EXPERTS=spec.num_experts,
                  GROUP_M=cfg.GROUP_M, W_HOPPER=layout.hopper_words, WIDE_SCALES=True, W_TILES=layout.tiles)
    _tail_tiles(consts, cfg, layout)
    args = [Arg.input("x_ptr"), Arg.param("w_ptr", spec.w13.name), Arg.param("s_ptr", spec.w13_scale.name),
            _weight("bias_ptr", spec.w13_bias), Arg.buffer("act_ptr", act), *groups]
    if spec.weight_on_input:
        consts["SCALE_ROWS"] = True
        args.append(_routing_weights(spec, "row_weights_ptr"))
    else:
        args.append(Arg.none("row_weights_ptr"))
    if ACTIVATIONS[spec.activation]:
        consts["ACTIVATION"] = ACTIVATIONS[spec.activation]
    entry = kernels.add(entry_name or f"glu_gemm.{cls}", "glu_gemm", args, consts, cfg.num_warps, cfg.num_stages)
    return Launch(entry, ("NB" if groups is _GROUPS else "NBS", f"cdiv({2 * spec.intermediate}, {cfg.BLOCK_N})"))


def _combine_gemm(spec: LayerSpec, layout: Layout, cls: str, cfg: TileConfig, fuse_cast: bool, slot_rows: bool,
                  kernels: _Kernels, *, groups=_GROUPS, act: str = "activations", weights: Arg | None = None,
                  unit_weights: bool | None = None, rows_to: str | None = None,
                  entry_name: str | None = None) -> Launch:
    """The w2 GEMM: bias, routing weight and the combine back to token order by fp32 atomics into the zeroed
    accumulator (``slot_rows``: each pair's output written as a row instead, for the deterministic combine; the
    shared expert writes its rows to ``rows_to``); with ``fuse_cast`` its last program per column tile also writes
    the tile in the output dtype (and adds the slot rows up); SPLIT_K programs per tile split I (the Hopper gemv
    tile)."""
    split = cfg.SPLIT_K
    unit = spec.weight_on_input if unit_weights is None else unit_weights
    consts = dict(HIDDEN=spec.hidden, INTERMEDIATE=spec.intermediate, TOP_K=spec.top_k,
                  HAS_BIAS=spec.w2_bias is not None, K_CONTIGUOUS=True,
                  BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
                  W_TMA=use_tma(cfg, tiled=layout.tiles), NUM_EXPERTS=spec.num_experts, GROUP_M=cfg.GROUP_M,
                  W_HOPPER=layout.hopper_words, WIDE_SCALES=True, FUSED_CAST=fuse_cast, W_TILES=layout.tiles,
                  SPLIT_K=split, SLOT_ROWS=slot_rows or rows_to is not None,
                  ROUND_ROWS=slot_rows and split > 1 and spec.dtype == "bfloat16", UNIT_WEIGHTS=unit)
    _tail_tiles(consts, cfg, layout)
    shared_rows = slot_rows and bool(spec.shared_intermediate) and fuse_cast
    if shared_rows:
        consts.update(SHARED=True, SHARED_GATE=_gated_in_combine(spec))
    cast_to = Arg.buffer("cast_ptr", "output") if fuse_cast else Arg.none("cast_ptr")
    if rows_to is not None:
        rows, ids = Arg.buffer("rows_ptr", rows_to), Arg.none("ids_ptr", "int32")
    elif slot_rows:
        rows = Arg.buffer("rows_ptr", "slot_rows" if split == 1 else "slot_partials")
        ids = Arg.buffer("ids_ptr", "expert_ids")
    else:
        rows, ids = Arg.none("rows_ptr"), Arg.none("ids_ptr", "int32")
    entry = kernels.add(entry_name or f"combine_gemm.{cls}", "combine_gemm", [
        Arg.buffer("act_ptr", act), Arg.param("w_ptr", spec.w2.name), Arg.param("s_ptr", spec.w2_scale.name),
        _weight("bias_ptr", spec.w2_bias), weights or _routing_weights(spec, "routing_weights_ptr"),
        Arg.buffer("out_ptr", "accumulator"), *groups, cast_to, Arg.scalar("num_tokens", "T"), rows, ids,
        *_shared_row_args(spec, shared_rows)], consts, cfg.num_warps, cfg.num_stages)
    return Launch(entry, ("NB" if groups is _GROUPS else "NBS", f"cdiv({spec.hidden}, {cfg.BLOCK_N})", split))


# ------------------------------------------------------------------------------------ the w4a8 form
#: rows x columns per program of the MXFP8 quantizer (``mxfp8_quant``); on sm_90 a program holds whole rows, up
#: to QUANT_ROW_VALUES values
QUANT_BLOCK_R, QUANT_BLOCK_C, QUANT_ROW_VALUES = 16, 256, 8192


def _quantize(src: str, dst: str, rows: str, cols: int, arch: int, block_k: int, kernels: _Kernels) -> Launch:
    """``src`` [rows, cols] -> MXFP8 (``dst``_q e4m3 bytes, ``dst``_scales bytes). sm_100: the OCP blocks as they
    are. sm_90: the groups of each row folded onto its largest scale (``FOLD``) and the bytes in the order of the
    Hopper w4a8 loop's K steps of ``block_k`` (``_w4a8_kernels``), so one program spans a row."""
    if arch >= 100:
        block_r, block_c, fold, hopper_k = QUANT_BLOCK_R, min(QUANT_BLOCK_C, _pow2(cols)), 1, 0
    else:
        block_c = _pow2(cols)
        block_r, fold, hopper_k = max(1, QUANT_ROW_VALUES // block_c), block_c // 32, block_k
    entry = kernels.add(f"mxfp8_quant.{src}", "mxfp8_quant", [
        Arg.input("x_ptr") if src == "x" else Arg.buffer("x_ptr", src), Arg.buffer("q_ptr", f"{dst}_q"),
        Arg.buffer("s_ptr", f"{dst}_scales"), Arg.scalar("num_rows", rows)],
        dict(COLS=cols, FOLD=fold, BLOCK_R=block_r, BLOCK_C=block_c, HOPPER_K=hopper_k), 4, 1)
    return Launch(entry, (f"cdiv({rows}, {block_r})", f"cdiv({cols}, {block_c})"))


def _glu_gemm_w4a8(spec: LayerSpec, arch: int, cls: str, cfg: TileConfig, kernels: _Kernels) -> Launch:
    """The w13 GEMM of the w4a8 form: MXFP8 x rows gathered by token, bias and GLU in the epilogue, the GLU output
    quantized to MXFP8 in expert-sorted order (``activations_q`` / ``_scales``)."""
    consts = dict(HIDDEN=spec.hidden, INTERMEDIATE=spec.intermediate, TOP_K=spec.top_k,
                  HAS_BIAS=spec.w13_bias is not None, INTERLEAVED=spec.interleaved,
                  SWIGLU_OAI=spec.activation == "swiglu_oai", ALPHA=spec.alpha, LIMIT=spec.limit,
                  ROUND_BF16=spec.dtype == "bfloat16", **_w4a8_tile(cfg, arch))
    if arch >= 100:
        out = [Arg.buffer("actq_ptr", "activations_q"), Arg.buffer("acts_ptr", "activations_scales"),
               Arg.none("act_ptr", spec.dtype)]
    else:  # sm_90: the GLU output in the layer's dtype, quantized by the next launch
        out = [Arg.none("actq_ptr", "uint8"), Arg.none("acts_ptr", "uint8"), Arg.buffer("act_ptr", "glu_output")]
    entry = kernels.add(f"glu_gemm_w4a8.{cls}", "glu_gemm_w4a8", [
        Arg.buffer("xq_ptr", "x_q"), Arg.buffer("xs_ptr", "x_scales"), Arg.param("w_ptr", spec.w13.name),
        Arg.param("s_ptr", spec.w13_scale.name), _weight("bias_ptr", spec.w13_bias), *out, *_GROUPS],
        consts, cfg.num_warps, cfg.num_stages)
    return Launch(entry, ("NB", f"cdiv({2 * spec.intermediate}, {cfg.BLOCK_N})"))


def _combine_gemm_w4a8(spec: LayerSpec, arch: int, cls: str, cfg: TileConfig, fuse_cast: bool, slot_rows: bool,
                       kernels: _Kernels) -> Launch:
    """The w2 GEMM of the w4a8 form on the MXFP8 GLU output; the combine as :func:`_combine_gemm`'s (no split K)."""
    consts = dict(HIDDEN=spec.hidden, INTERMEDIATE=spec.intermediate, TOP_K=spec.top_k,
                  HAS_BIAS=spec.w2_bias is not None, **_w4a8_tile(cfg, arch), FUSED_CAST=fuse_cast,
                  SLOT_ROWS=slot_rows)
    cast_to = Arg.buffer("cast_ptr", "output") if fuse_cast else Arg.none("cast_ptr")
    if slot_rows:
        rows, ids = Arg.buffer("rows_ptr", "slot_rows"), Arg.buffer("ids_ptr", "expert_ids")
    else:
        rows, ids = Arg.none("rows_ptr"), Arg.none("ids_ptr", "int32")
    entry = kernels.add(f"combine_gemm_w4a8.{cls}", "combine_gemm_w4a8", [
        Arg.buffer("actq_ptr", "activations_q"), Arg.buffer("acts_ptr", "activations_scales"),
        Arg.param("w_ptr", spec.w2.name), Arg.param("s_ptr", spec.w2_scale.name), _weight("bias_ptr", spec.w2_bias),
        _routing_weights(spec, "routing_weights_ptr"), Arg.buffer("out_ptr", "accumulator"), *_GROUPS,
        cast_to, Arg.scalar("num_tokens", "T"), rows, ids], consts, cfg.num_warps, cfg.num_stages)
    return Launch(entry, ("NB", f"cdiv({spec.hidden}, {cfg.BLOCK_N})", 1))


def _w4a8_tile(cfg: TileConfig, arch: int) -> dict[str, Any]:
    """A w4a8 GEMM's tile constants: sm_100 swaps the MMA's operands for token tiles under its 128-row M."""
    return dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                SWAP_AB=arch >= 100 and cfg.BLOCK_M < NATIVE_MMA_M, FP8_HOPPER=arch < 100, PROMOTE=cfg.PROMOTE)
