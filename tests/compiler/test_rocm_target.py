"""The ROCm targets, on a machine without an AMD GPU (docs/amd.md).

* What the compiled modules run, read from the AMDGPU assembly IREE dumps (``mxmoe.compiler.rocm_isa``): the expert
  GEMMs are MFMA (``v_mfma_f32_*_bf16``; gfx950 with ``activations="mxfp8"``: the scaled ``v_mfma_scale_f32_*_f8f6f4``),
  never vector FMAs, and no dispatch of their own dequantizes weights (so no bf16 copy of them in global memory).
* A grid of layer shapes (E, k, H, I: powers of two and not, small and model-sized) compiles for both archs, each
  expert dispatch on the matrix cores; a shape the layer refuses is one line, never an iree-compile failure.
* Numerics: the linalg each ROCm target emits, compiled for this CPU (``rocm_form_on_cpu``), against the reference:
  the exact weight decodes of both archs, over every e2m1 code and scale, and the MXFP8 form against the reference
  that quantizes the same way. (tests/torch_frontend/test_entries.py runs every interface feature on both archs'
  bf16 forms.)
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import torch

import mxmoe
from mxmoe.compiler import rocm_isa
from mxmoe.compiler.targets import get_target
from mxmoe.core import mxfp4
from mxmoe.core.config import MoEConfig, PRESETS
from mxmoe.core.reference import numpy_reference, relative_error
from mxmoe.torch_frontend import MoE

MFMA = {"bf16": r"\bv_mfma_f32_\d+x\d+x\d+_?bf16\b", "mxfp8": r"\bv_mfma_scale_f32_\d+x\d+x\d+_f8f6f4\b"}
FORMS = [("gfx942", "bf16"), ("gfx950", "bf16"), ("gfx950", "mxfp8")]


def _compile_dump(layer: MoE, arch: str, activations: str, tmp_path, **kw):
    d = tmp_path / f"{arch}-{activations}"
    cm = mxmoe.compile(layer, target=f"rocm:{arch}", activations=activations,
                       extra_flags=[f"--iree-hal-dump-executable-files-to={d}"], **kw)
    return cm, rocm_isa.kernels(d)


def _check_matrix_cores(kernels: dict, activations: str, expected: int) -> dict:
    """``expected`` expert dispatches (two per grouped matmul: 16-row and 64-row blocks), each running the expected
    MFMA and no vector FMA; no dispatch decodes weights on its own."""
    experts = rocm_isa.expert_dispatches(kernels)
    assert len(experts) == expected, f"expert dispatches: {[rocm_isa.short_name(k) for k in experts]}"
    for name, lines in experts.items():
        m = rocm_isa.mix(lines)
        assert any(re.search(MFMA[activations], ln) for ln in lines), (rocm_isa.short_name(name), m)
        assert m["vector_fma"] == 0, (rocm_isa.short_name(name), m)
    assert not [k for k in kernels if "f4E2M1FN" in k and k not in experts], "a dispatch of its own decodes weights"
    return experts


@pytest.mark.parametrize("arch, activations", FORMS, ids=[f"{a}-{f}" for a, f in FORMS])
def test_expert_gemms_run_on_the_matrix_cores(arch, activations, tmp_path):
    """The ISA of a small layer (a shared expert too: its E=1 grouped matmuls): 4 grouped matmuls, each two expert
    dispatches (blocks of 16 rows for few tokens, of 64 for many), each MFMA."""
    layer = MoE.random(MoEConfig(num_experts=8, top_k=2, hidden=256, intermediate=128, shared_intermediate=128), seed=0)
    cm, kernels = _compile_dump(layer, arch, activations, tmp_path)
    experts = _check_matrix_cores(kernels, activations, expected=8)
    assert cm.target.activations == activations and cm.target.record(cm.code)["activations"] == activations
    # in the K loop, the packed weights are read in 4-byte loads or wider (16 bytes in gfx950's 16-row blocks), never
    # byte by byte; the activations in 16-byte loads; the scales are one byte per 32 weights
    loads = rocm_isa.binding_loads(tmp_path / f"{arch}-{activations}", loop=True)
    for name, lines in experts.items():
        assert rocm_isa.main_loop(lines), rocm_isa.short_name(name)
        got = loads[name]
        assert min(got["weights"]) >= 4, (rocm_isa.short_name(name), got)
        if activations == "bf16":
            assert min(got["activations"]) == 16, (rocm_isa.short_name(name), got)
        if arch == "gfx950" and activations == "bf16" and "_Dx16x" in name:
            assert set(got["weights"]) == {16}, (rocm_isa.short_name(name), got)


#: (E, k, H, I): odd sizes, powers of two, the model shapes that failed with "failed to distribute" before (Qwen3-30B-A3B,
#: E=32 k=4 H=I=2048), gpt-oss-20b
GRID = [(1, 1, 64, 64), (2, 1, 32, 32), (3, 2, 96, 160), (128, 8, 2048, 768), (32, 4, 2048, 2048), (32, 4, 2880, 2880)]
#: more model shapes (slow: iree-compile takes ~10 s each here)
GRID_SLOW = [(16, 4, 256, 128), (60, 4, 2048, 1408), (128, 4, 2880, 2880), (8, 2, 4096, 14336), (64, 8, 7168, 2048),
             (256, 8, 7168, 2048)]


def _grid_case(shape, tmp_path):
    e, k, h, i = shape
    layer = MoE.random(MoEConfig(num_experts=e, top_k=k, hidden=h, intermediate=i), seed=0)
    for arch in ("gfx942", "gfx950"):
        _, kernels = _compile_dump(layer, arch, "bf16", tmp_path)
        _check_matrix_cores(kernels, "bf16", expected=4)


@pytest.mark.parametrize("shape", GRID, ids=[",".join(map(str, s)) for s in GRID])
def test_shape_grid_compiles_for_both_archs(shape, tmp_path):
    _grid_case(shape, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("shape", GRID_SLOW, ids=[",".join(map(str, s)) for s in GRID_SLOW])
def test_shape_grid_model_sized(shape, tmp_path):
    _grid_case(shape, tmp_path)


#: the MoE families' layers beyond gpt-oss's (routers, activations, the interface features), awkward sizes (12 experts,
#: H 96, I 160: not multiples of the scaled MFMA's 128), compiled with every entry point (layer, monolithic, modular)
_SMALL = dict(num_experts=12, top_k=2, hidden=96, intermediate=160, activation="silu", interleaved=False, bias=False)
FAMILIES = {
    # DeepSeek-V3: group-limited sigmoid top-k with its correction bias, fp32 router, scaling; expert map; bf16 shared
    # expert with a gate; gelu
    "deepseek-ep-gelu": dict(routing="sigmoid_topk", top_k=3, n_group=4, topk_group=2, score_bias=True, renormalize=True,
                             routed_scaling_factor=2.5, router_fp32=True, router_bias=False, global_num_experts=20,
                             activation="gelu", shared_intermediate=96, shared_gate=True, shared_format="bf16"),
    # Llama-4: top-1 sigmoid, router weight on the input; MXFP4 shared expert with a gate (E=1 grouped matmuls);
    # biases, interleaved gelu_tanh
    "llama4-shared-mxfp4": dict(routing="topk_sigmoid", top_k=1, apply_router_weight_on_input=True, router_bias=False,
                                shared_intermediate=64, shared_gate=True, activation="gelu_tanh", interleaved=True,
                                bias=True),
    # group-limited sigmoid top-k on a bf16 router, clamped SiLU, MXFP4 shared expert without a gate
    "sigmoid-groups-clamped": dict(routing="sigmoid_topk", top_k=3, n_group=3, topk_group=2, score_bias=True,
                                   activation="silu_clamped", swiglu_limit=0.75, shared_intermediate=64),
    # softmax top-k renormalized and scaled, gpt-oss's GLU with biases, an expert map covering every expert
    "softmax-scaled-oai": dict(routing="softmax_topk", renormalize=True, routed_scaling_factor=1.75,
                               activation="swiglu_oai", interleaved=True, bias=True, global_num_experts=12),
}
#: the families checked in CI (each ~20 s: two archs); the others are slow
FAMILIES_CI = ("deepseek-ep-gelu", "llama4-shared-mxfp4")


def _family_case(name: str, tmp_path, forms=FORMS):
    cfg = MoEConfig(**{**_SMALL, **FAMILIES[name]})
    layer = MoE.random(cfg, seed=0)
    grouped = 2 + (2 if cfg.shared_intermediate and cfg.shared_format == "mxfp4" else 0)
    for arch, activations in forms:
        cm, kernels = _compile_dump(layer, arch, activations, tmp_path, entries="all")
        assert {e.name for e in cm.entries} == {"layer", "monolithic", "modular"}
        _check_matrix_cores(kernels, activations, expected=2 * grouped)


@pytest.mark.parametrize("name", FAMILIES_CI)
def test_moe_families_compile_for_both_archs(name, tmp_path):
    """Every router, activation and interface feature the cpu target compiles (tests/torch_frontend/test_routings.py,
    test_entries.py) compiles for rocm too, all three entries in one module, the expert GEMMs on the matrix cores
    (the mxfp8 form for one family: K 96 padded to 128)."""
    forms = FORMS if name == FAMILIES_CI[0] else FORMS[:2]
    _family_case(name, tmp_path, forms)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in FAMILIES_CI])
def test_more_moe_families_compile_for_both_archs(name, tmp_path):
    _family_case(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "llama-4-scout", "qwen1.5-moe-a2.7b"])
def test_family_presets_compile_for_both_archs(name, tmp_path):
    """The released models' layer shapes and semantics (core/config.py PRESETS), as the layer entry."""
    cfg = PRESETS[name]
    layer = MoE.random(cfg, seed=0)
    grouped = 2 + (2 if cfg.shared_intermediate and cfg.shared_format == "mxfp4" else 0)
    for arch in ("gfx942", "gfx950"):
        _, kernels = _compile_dump(layer, arch, "bf16", tmp_path)
        _check_matrix_cores(kernels, "bf16", expected=2 * grouped)


def test_numerics_options_are_refused_in_one_line():
    """Nothing has run on an AMD GPU, so the rocm targets promise neither determinism nor batch invariance."""
    layer = MoE.random(PRESETS["tiny"], seed=0)
    for kw in (dict(deterministic=True), dict(batch_invariant=True)):
        with pytest.raises(ValueError, match=r"^target rocm:gfx950 does not offer deterministic or batch-invariant "
                                             r"compiles \(compile-only here: never measured\)$"):
            mxmoe.compile(layer, target="rocm:gfx950", **kw)


def test_scaled_form_at_gpt_oss_shape(tmp_path):
    """K = 2880 is not a multiple of the scaled MFMA's 128: the mxfp8 form pads it (2944) and runs the scaled MFMA."""
    layer = MoE.random(PRESETS["gpt-oss-20b"], seed=0)
    cm, kernels = _compile_dump(layer, "gfx950", "mxfp8", tmp_path)
    _check_matrix_cores(kernels, "mxfp8", expected=4)
    assert any(f.padded_shape[-1] == 2944 // 2 for f in cm.stored_forms.values() if f.role == "values")


def test_a_shape_the_layer_refuses_is_one_line():
    with pytest.raises(ValueError, match=r"^MoEConfig: hidden=1000 is not a multiple of the MXFP4 block \(32\)$"):
        MoEConfig(num_experts=64, top_k=6, hidden=1000, intermediate=320)


def test_activation_option_errors():
    with pytest.raises(ValueError, match=r"activations='mxfp8' feeds the scaled MFMA of gfx950; gfx942 has none"):
        get_target("rocm:gfx942").with_activations("mxfp8")
    with pytest.raises(ValueError, match="activations must be one of bf16, mxfp8, got 'fp4'"):
        get_target("rocm:gfx950").with_activations("fp4")
    with pytest.raises(ValueError, match="target cpu: activations must be one of bf16, mxint8, mxint16, got 'mxfp8'"):
        mxmoe.compile(MoE.random(PRESETS["tiny"], seed=0), target="cpu", activations="mxfp8")
    assert get_target("rocm:gfx950").with_activations("mxfp8").passes()[3] == ("mxmoe-pad", "128")


# ------------------------------------------------------------------------------------ IREE 3.13's gaps (docs/amd.md)
#: file in tests/compiler/iree_gaps -> (arch, what iree-compile says, or None: compiles without any MFMA)
IREE_GAPS = {"failed_to_distribute.mlir": ("gfx942", "failed to distribute"),
             "extf_f4_to_f8.mlir": ("gfx950", "missing `LLVMTranslationDialectInterface` registration"),
             "f4_rank_reducing_slice.mlir": ("gfx950", "expected operand #0 rank (3) to match the result rank"),
             "scaled_f8_by_f4.mlir": ("gfx950", None)}


@pytest.mark.parametrize("name", list(IREE_GAPS))
def test_the_iree_gaps_the_lowering_works_around_are_still_there(name, tmp_path):
    """The smallest IR of each IREE 3.13 gap rocm_grouped.py works around: when an IREE upgrade closes one, this
    fails, and the workaround (the file's comment) can go."""
    from pathlib import Path

    from iree.compiler import CompilerToolError, compile_file

    arch, message = IREE_GAPS[name]
    path = Path(__file__).parent / "iree_gaps" / name
    flags = ["--iree-hal-target-device=hip", f"--iree-rocm-target={arch}",
             f"--iree-hal-dump-executable-files-to={tmp_path}"]
    if message is None:
        compile_file(str(path), extra_args=flags)
        kernels = rocm_isa.kernels(tmp_path)
        assert kernels and not any(rocm_isa.mix(k)["mfma"] + rocm_isa.mix(k)["mfma_scale"] for k in kernels.values())
    else:
        with pytest.raises(CompilerToolError, match=re.escape(message)):
            compile_file(str(path), extra_args=flags)


# ----------------------------------------------------------------------------------------------- numerics (CPU)
class _GroupedMatmul(torch.nn.Module):
    def __init__(self, w, s):
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("s", s)

    def forward(self, x, ids):
        return torch.ops.mxmoe.mxfp4_grouped_matmul(x, ids, self.w, self.s, None)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_weight_decode_is_exact_for_every_code_and_scale(arch, rocm_form_on_cpu):
    """Expert 1 holds every e2m1 code (twice per row) under every scale byte 2..250 (one per row); 32 one-hot tokens
    read its dequantized weights back through the row blocks, the decode (gfx942: integer ops; gfx950:
    ``arith.scaling_extf``) and the contraction: bit-exact bf16. (Bytes 0 and 1 make subnormal weights, which this
    CPU flushes; 251..254 overflow into inf for the large codes; 255 is NaN: refused at compile time.)"""
    import mxmoe.torch_frontend.ops  # noqa: F401  (registers the ops)

    scales = np.arange(2, 251, dtype=np.uint8)
    n = len(scales)
    codes = np.tile(np.arange(16, dtype=np.uint8), 2)
    row = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    w = np.zeros((2, n, 16), np.uint8)
    w[1] = row
    s = np.full((2, n, 1), 127, np.uint8)
    s[1, :, 0] = scales
    x = torch.eye(32, dtype=torch.bfloat16)
    ids = torch.ones(32, 1, dtype=torch.int32)
    module = _GroupedMatmul(torch.from_numpy(w), torch.from_numpy(s))
    cm = mxmoe.compile(module, target=rocm_form_on_cpu(arch), example_inputs=(x, ids))
    out = cm(x, ids).float().numpy()[:, 0, :].T                                   # [n, 32]
    ref = mxfp4.dequantize(w[1], s[1]).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(out, ref)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_large_blocks_match_the_reference(arch, rocm_form_on_cpu):
    """Enough tokens for the 64-row blocks (slots >= 48 per expert), with another rank's experts (-1 ids), biases and
    a gated shared expert, and a routing that leaves experts idle and piles tokens on others."""
    from mxmoe.compiler.passes.lowering import rocm_grouped

    cfg = MoEConfig(num_experts=8, top_k=2, hidden=128, intermediate=96, global_num_experts=12, shared_intermediate=64,
                    shared_gate=True)
    layer = MoE.random(cfg, seed=5)
    cm = mxmoe.compile(layer, target=rocm_form_on_cpu(arch), entries=["modular"])
    t = rocm_grouped.LARGE_BLOCK_MIN_ROWS * cfg.num_experts // cfg.top_k + 5
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, cfg.hidden, generator=g).bfloat16()
    w = torch.rand(t, cfg.top_k, generator=g) + 0.05
    ids = torch.randint(0, 5, (t, cfg.top_k), generator=g, dtype=torch.int32) * 2  # even global ids only
    ids[::3, 1] = 11                                                                # often another rank's expert
    err = relative_error(cm.entry("modular")(x, w, ids).float().numpy(), layer.modular(x, w, ids).float().numpy())
    assert err <= 2e-2, err


MXFP8_FEATURES = {
    "plain": {},
    "expert-parallel": dict(global_num_experts=20),
    "weight-on-input": dict(top_k=1, apply_router_weight_on_input=True),
    "shared-mxfp4-gate": dict(shared_intermediate=64, shared_gate=True, routing="softmax_topk", renormalize=True),
}


@pytest.mark.parametrize("feature", list(MXFP8_FEATURES))
def test_mxfp8_form_matches_its_reference(feature, rocm_form_on_cpu):
    """The gfx950 mxfp8 form computes what ``numpy_reference(activations="mxfp8")`` says (each MXFP4 matmul's
    activations quantized to MXFP8), and stays within the documented distance of the bf16 reference."""
    cfg = MoEConfig(**{**dict(num_experts=8, top_k=2, hidden=256, intermediate=128, activation="silu",
                               interleaved=False), **MXFP8_FEATURES[feature]})
    layer = MoE.random(cfg, seed=3)
    cm = mxmoe.compile(layer, target=rocm_form_on_cpu("gfx950", "mxfp8"))
    w8 = layer.to_weights()
    for t in (1, 7, 33, 200):
        x = torch.randn(t, cfg.hidden, generator=torch.Generator().manual_seed(t)).bfloat16()
        out = cm(x).float().numpy()
        ref8 = numpy_reference(w8, x.float().numpy(), ml_dtypes.bfloat16, activations="mxfp8")
        ref = numpy_reference(w8, x.float().numpy(), ml_dtypes.bfloat16)
        assert relative_error(out, ref8) <= 1e-2, (t, relative_error(out, ref8))
        assert relative_error(out, ref) <= 0.1, (t, relative_error(out, ref))


def test_mxfp8_entries_with_k_padded_to_the_scaled_mfma(rocm_form_on_cpu):
    """All three entries in one mxfp8 module (they share the weight globals the pad pass pads: H 96 and I 160 to
    128 and 256), with group-limited sigmoid routing, an expert map and a gated shared expert, against the reference
    that quantizes the same way; ids of another rank or out of range contribute nothing."""
    cfg = MoEConfig(**{**_SMALL, **FAMILIES["deepseek-ep-gelu"], "shared_format": "mxfp4"})
    layer = MoE.random(cfg, seed=4)
    cm = mxmoe.compile(layer, target=rocm_form_on_cpu("gfx950", "mxfp8"), entries="all")
    w8 = layer.to_weights()
    g = torch.Generator().manual_seed(1)
    for t in (1, 33):
        x = torch.randn(t, cfg.hidden, generator=g).bfloat16()
        xs = x.float().numpy()
        logits = torch.randn(t, cfg.experts_routed, generator=g)
        w = torch.rand(t, cfg.top_k, generator=g) + 0.05
        ids = torch.randint(-1, cfg.experts_routed + 2, (t, cfg.top_k), generator=g, dtype=torch.int32)
        got = {"layer": cm(x), "monolithic": cm.entry("monolithic")(x, logits),
               "modular": cm.entry("modular")(x, w, ids)}
        kws = {"layer": {}, "monolithic": dict(router_logits=logits.numpy()),
               "modular": dict(topk_weights=w.numpy(), topk_ids=ids.numpy())}
        for entry, out in got.items():
            ref8 = numpy_reference(w8, xs, ml_dtypes.bfloat16, entry=entry, activations="mxfp8", **kws[entry])
            assert relative_error(out.float().numpy(), ref8) <= 1e-2, (entry, t, relative_error(out.float().numpy(), ref8))


def test_mxfp8_round_trip():
    """OCP MX rules: scale 2^(floor(log2 amax) - 8), elements rounded to nearest even e4m3, saturated at 448."""
    x = np.zeros((3, 32), np.float32)
    x[0] = np.linspace(-3, 3, 32)
    x[0, 31] = 5.0                   # amax 5: scale 2^(2 - 8); 5 * 2^6 = 320 <= 448
    x[1] = 1e-3                      # scale 2^(-10 - 8); 1e-3 * 2^18 = 262.1 -> 256 (e4m3 steps of 32 there)
    x[2] = 7.5                       # amax 7.5: scale 2^(2 - 8); 7.5 * 2^6 = 480 saturates to 448
    y = mxfp4.mxfp8_round_trip(x)
    scale = 2.0 ** -6
    assert np.array_equal(y[0], (x[0] / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale)
    assert np.all(y[1] == 256 * 2.0 ** -18) and np.all(y[2] == 448 * scale)
    assert np.abs(y[0] - x[0]).max() <= 2.0 ** -4 * np.abs(x[0]).max()
