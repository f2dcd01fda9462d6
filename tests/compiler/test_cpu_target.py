"""mxmoe.compile(target="cpu") against the reference MoE forward, and the IREE targets that only compile here.

Each configuration is compiled once (module-scoped fixtures) and run at several token counts: the token
dimension is dynamic, so one compiled module serves them all. Error metric: max |out - ref| / max |ref|
over the whole output, in fp32; the bf16 outputs agree to about 1e-3 (a few bf16 ulps where an fp32
sum in a different order rounds the other way), the bound is 1e-2.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

pytest.importorskip("iree.compiler", reason="the compiler's IREE bindings (a GPU machine may lack them)")

import mxmoe
from mxmoe.compiler import iree_backend
from mxmoe.kernels import cpu as ukernels
from mxmoe.compiler.targets import TARGETS
from mxmoe.core.config import PRESETS
from mxmoe.core.layouts import CPU_BLOCKSPLIT, CPU_ROWS16
from mxmoe.core.swizzle import blocksplit_swizzle, blocksplit_unswizzle
from mxmoe.torch_frontend.moe import MoE

TOKENS = (1, 7, 64, 333)
TOL = 1e-2

TINY = PRESETS["tiny"]
CONFIGS = {
    "gpt-oss": TINY,
    "softmax-renorm-silu-nobias-split": TINY.replace(routing="softmax_topk", renormalize=True, activation="silu",
                                                    bias=False, interleaved=False),
    "softmax-swiglu-bias-split": TINY.replace(routing="softmax_topk", renormalize=False, interleaved=False),
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    return float((out - ref).abs().max() / ref.abs().max())


def inputs(T: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, hidden, generator=g).to(torch.bfloat16)


def check_tokens(cm, moe: MoE, tokens=TOKENS, seed=0) -> list[float]:
    errs = []
    for T in tokens:
        x = inputs(T, moe.config.hidden, seed + T)
        ref = moe(x)
        out = cm(x)
        assert out.dtype == torch.bfloat16 and out.shape == (T, moe.config.hidden)
        errs.append(rel_err(out, ref))
        assert errs[-1] < TOL, f"T={T}: relative error {errs[-1]:.2e}"
    return errs


@pytest.fixture(scope="module", params=list(CONFIGS))
def compiled(request):
    moe = MoE.random(CONFIGS[request.param], seed=3)
    calls = []
    real = iree_backend.compile_to_vmfb

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    iree_backend.compile_to_vmfb = counting
    try:
        cm = mxmoe.compile(moe, target="cpu")
    finally:
        iree_backend.compile_to_vmfb = real
    return request.param, moe, cm, calls


def test_numerics_variants(compiled):
    name, moe, cm, calls = compiled
    assert cm.target.layout == CPU_BLOCKSPLIT
    assert cm.inputs[0].shape[0] is None  # dynamic token count
    errs = check_tokens(cm, moe)
    executor = cm.executor()
    # one compile served every token count; the same executor ran them
    assert len(calls) == 1 and cm.executor() is executor
    print(f"{name}: relative errors at T={TOKENS}: {['%.1e' % e for e in errs]}")


def test_weights_stored_in_cpu_layout(compiled):
    _, moe, cm, _ = compiled
    forms = {f.role: (n, f) for n, f in cm.stored_forms.items() if f.layout is not None and "w13" in n.lower()
             and f.role == "values"}
    assert forms, f"no w13 values global among {list(cm.stored_forms)}"
    name, form = forms["values"]
    # bf16 layers: blocksplit, or rows16 where the microkernel runs the AMX form (kernels/cpu/bf16_rows16.c)
    uk = ukernels.matvec_object()
    layout = CPU_ROWS16 if uk.path and ukernels.bf16_layout(uk.flavor) == "rows16" else CPU_BLOCKSPLIT
    assert form.layout == layout.name
    stored = cm.parameters[name]
    assert np.array_equal(layout.decode("values", stored.view(np.uint8)), moe.w13.numpy())


def test_blocksplit_round_trip_and_order():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, size=(2, 3, 64), dtype=np.uint8)
    s = blocksplit_swizzle(a)
    assert np.array_equal(blocksplit_unswizzle(s), a)
    # value j of a block: row-major byte j//2, nibble j%2; blocksplit byte j%16, nibble j//16
    vals = np.stack([a & 15, a >> 4], -1).reshape(2, 3, 128)
    for j in (0, 1, 15, 16, 17, 31, 32, 63):
        blk, i = divmod(j, 32)
        byte = s[..., blk * 16 + i % 16]
        assert np.array_equal((byte >> (4 * (i // 16))) & 15, vals[..., j])
    with pytest.raises(ValueError, match="multiple of 16"):
        blocksplit_swizzle(np.zeros((2, 8), np.uint8))


@pytest.fixture(scope="module")
def one_expert():
    """top_k=1 and a router that always picks expert 5: every token on one expert, 7 experts idle."""
    moe = MoE.random(TINY.replace(top_k=1), seed=4)
    with torch.no_grad():
        moe.router_weight.zero_()
        moe.router_bias.copy_(torch.arange(8, dtype=torch.float32).neg().to(moe.router_bias.dtype))
        moe.router_bias[5] = 10.0
    return moe, mxmoe.compile(moe, target="cpu")


def test_all_tokens_on_one_expert(one_expert):
    moe, cm = one_expert
    x = inputs(64, moe.config.hidden, 1)
    ids = torch.ops.mxmoe.route(torch.nn.functional.linear(x, moe.router_weight, moe.router_bias), 1,
                                "topk_softmax", False)[1]
    assert (ids == 5).all()
    check_tokens(cm, moe, tokens=(1, 5, 32, 64, 333))  # 32: one expert, 8 row groups in the microkernel


def test_experts_with_no_tokens_do_not_matter(one_expert):
    """Idle experts are never read: changing their weights after compiling changes nothing."""
    moe, cm = one_expert
    x = inputs(7, moe.config.hidden, 2)
    before = cm(x)
    params = dict(cm.parameters)
    for name, form in cm.stored_forms.items():
        if form.role == "values":
            arr = params[name].copy()
            arr[[e for e in range(8) if e != 5]] = 0x77  # garbage for every idle expert
            params[name] = arr
    again = cm.with_parameters(params)
    assert torch.equal(again(x), before)


def test_padding_with_a_larger_pad_multiple():
    moe = MoE.random(TINY, seed=5)
    target = dataclasses.replace(TARGETS["cpu"], pad_multiple=128)
    cm = mxmoe.compile(moe, target=target)
    padded = [f for f in cm.stored_forms.values() if f.padded_shape != f.shape]
    assert padded, "H=64 and I=96 must be padded to 128"
    assert any(128 in f.padded_shape for f in padded)
    check_tokens(cm, moe, tokens=(1, 7, 64))


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_rocm_targets_compile(arch):
    moe = MoE.random(TINY, seed=6)
    cm = mxmoe.compile(moe, target=f"rocm:{arch}")
    assert cm.vmfb and arch.encode() in cm.vmfb
    assert cm.target.name == f"rocm:{arch}"
    with pytest.raises(RuntimeError, match=f"target rocm:{arch} needs an AMD MI3.. GPU \\({arch}\\); this machine has none"):
        cm(inputs(1, TINY.hidden, 0))


def test_unknown_target_is_rejected():
    moe = MoE.random(TINY, seed=0)
    with pytest.raises(ValueError, match="rocm:gfx000"):
        mxmoe.compile(moe, target="rocm:gfx000")


@pytest.mark.slow
def test_gpt_oss_20b_shapes():
    moe = MoE.random(PRESETS["gpt-oss-20b"], seed=0)
    cm = mxmoe.compile(moe, target="cpu")
    errs = check_tokens(cm, moe, tokens=(1, 8, 64))
    print(f"gpt-oss-20b relative errors at T=1, 8, 64: {['%.1e' % e for e in errs]}")


@pytest.mark.slow
@pytest.mark.parametrize("path", ["microkernel", "linalg"])
def test_gpt_oss_20b_repeated_calls_do_not_grow_memory(rss_bytes, path, request):
    """Repeated 256-token calls keep RSS flat, through the microkernel's one dispatch and through the linalg
    expert loop (experts take the decode-once kernel). With one packed read back per loop iteration, IREE
    3.13's local-task device kept ~110 MB per call here (docs/cpu.md); the dependent three-read form keeps
    one expert's work in flight and nothing grows."""
    if path == "linalg":
        request.getfixturevalue("linalg_matvec")
    moe = MoE.random(PRESETS["gpt-oss-20b"], seed=0)
    cm = mxmoe.compile(moe, target="cpu")
    x = torch.randn(256, moe.config.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for _ in range(2):
        cm(x)
    before = rss_bytes()
    for _ in range(6):
        cm(x)
    grown = rss_bytes() - before
    assert grown < 64 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB over 6 calls at 256 tokens"


def test_scaling_extf_decode_variant(monkeypatch, linalg_matvec):
    """The decode-once kernel's arith.scaling_extf form (f4E2M1FN / f8E8M0FNU bitcasts, activations gathered
    in the bytes' storage order) is exact too; it is not the default because it measured slower here."""
    from mxmoe.compiler.passes.lowering import cpu_grouped

    monkeypatch.setattr(cpu_grouped, "DECODE_FOR_MATMUL", "scaling_extf")
    monkeypatch.setattr(cpu_grouped, "SMALL_ROWS", 1)  # most experts take the decode-once kernel
    moe = MoE.random(TINY, seed=7)
    cm = mxmoe.compile(moe, target="cpu")
    assert "arith.scaling_extf" in cm.mlir and "f4E2M1FN" in cm.mlir and "f8E8M0FNU" in cm.mlir
    check_tokens(cm, moe, tokens=(7, 64))


@pytest.mark.parametrize("form,decode,readback", [("lanes8", "int", "separate"), ("lanes8", "signmag", "packed")])
def test_matvec_fallback_variants(monkeypatch, linalg_matvec, form, decode, readback):
    """The first lane matvec (8 lanes, ``code_value_lines`` decode, three read backs per expert) and its
    sign/magnitude decode stay selectable and exact; the default is the block matvec (docs/cpu.md)."""
    from mxmoe.compiler.passes.lowering import cpu_grouped

    monkeypatch.setattr(cpu_grouped, "MATVEC_FORM", form)
    monkeypatch.setattr(cpu_grouped, "MATVEC_DECODE", decode)
    monkeypatch.setattr(cpu_grouped, "LOOP_READBACK", readback)
    moe = MoE.random(TINY, seed=8)
    cm = mxmoe.compile(moe, target="cpu")
    check_tokens(cm, moe, tokens=(1, 7, 64))


def test_read_back_all_and_per_iteration_expert_loops_agree(monkeypatch, linalg_matvec):
    """Up to READBACK_ALL_SLOTS slots the expert loop reads the first READBACK_ENTRIES entries back before it
    starts (later ones in their iteration); above, one read back per iteration. All give bit-identical
    outputs."""
    from mxmoe.compiler.passes.lowering import cpu_grouped

    moe = MoE.random(TINY, seed=9)
    upfront = mxmoe.compile(moe, target="cpu")
    monkeypatch.setattr(cpu_grouped, "READBACK_ENTRIES", 2)  # E = 4: experts 3 and 4 read in their iteration
    partly = mxmoe.compile(moe, target="cpu")
    monkeypatch.setattr(cpu_grouped, "READBACK_ALL_SLOTS", 0)
    per_iteration = mxmoe.compile(moe, target="cpu")
    assert "scf.index_switch" in upfront.mlir and "scf.index_switch" not in per_iteration.mlir
    for T in (1, 2, 3, 17):
        x = torch.randn(T, TINY.hidden, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
        assert torch.equal(upfront(x), per_iteration(x)) and torch.equal(partly(x), per_iteration(x)), T
    check_tokens(upfront, moe, tokens=(1, 2, 17))


def test_block_matvec_signmag_decode_variant(monkeypatch, linalg_matvec):
    """The block matvec's previous nibble decode (f32 bit ops) stays selectable and exact."""
    from mxmoe.compiler.passes.lowering import cpu_grouped

    monkeypatch.setattr(cpu_grouped, "BLOCK_DECODE", "signmag")
    monkeypatch.setattr(cpu_grouped, "MATVEC_F32_ROWS", False)
    moe = MoE.random(TINY, seed=10)
    cm = mxmoe.compile(moe, target="cpu")
    check_tokens(cm, moe, tokens=(1, 7))


def test_contraction_reading_input_type_rows_variant(monkeypatch, linalg_matvec):
    """``MATMUL_F32_ROWS = False``: the decode-once contraction reads rows gathered in the activations' own
    type (a second gather) and converts in its loop, the form before it shared the matvec's f32 rows."""
    from mxmoe.compiler.passes.lowering import cpu_grouped

    monkeypatch.setattr(cpu_grouped, "MATMUL_F32_ROWS", False)
    moe = MoE.random(TINY, seed=12)
    cm = mxmoe.compile(moe, target="cpu")
    contraction_rows = re.findall(r'"reduction", "reduction"\]\} ins\([^)]*: tensor<\?x\d+x32x(\w+)>, tensor<\d+x\d+x32xf32>\)',
                                  cm.mlir)
    assert contraction_rows and set(contraction_rows) == {"bf16"}, contraction_rows
    check_tokens(cm, moe, tokens=(5, 333))


@pytest.mark.parametrize("path", ["microkernel", "linalg"])
def test_every_code_and_extreme_scales_through_the_matvec(path, request):
    """Every byte value (both nibbles: all 16 e2m1 codes incl. -0 and the subnormal 0.5) in the w13 and w2
    weights, with block scales from 2^-127 (e8m0 byte 0, an f32 subnormal) to 2^13, through the matvec the
    few-token path uses (the C microkernel, or the linalg one with its f16 decode and 2^14 correction):
    bit-identical to the reference would be too strict (sum order), so the usual bound. A NaN scale (0xFF) is
    refused when compiling (docs/user-guide.md, failure behaviour); bound past that check, it must still give NaN
    where it is used."""
    if path == "linalg":
        request.getfixturevalue("linalg_matvec")
    elif ukernels.matvec_object().path is None:
        pytest.skip(f"no cpu microkernel here: {ukernels.matvec_object().reason}")
    moe = MoE.random(TINY, seed=11)
    with torch.no_grad():
        for w in (moe.w13, moe.w2):
            w.copy_((torch.arange(w.numel()) * 7 % 256).to(torch.uint8).view(w.shape))
        for s, big in ((moe.w13_scale, 127 + 13), (moe.w2_scale, 127 + 2)):
            pattern = torch.tensor([0, 1, 100, 118, 120, 127, big], dtype=torch.uint8)
            s.copy_(pattern[torch.arange(s.numel()) % len(pattern)].view(s.shape))
    cm = mxmoe.compile(moe, target="cpu")
    assert ("stream.executable" in cm.mlir) == (path == "microkernel")
    for T in (1, 2, 7):
        x = inputs(T, moe.config.hidden, 100 + T)
        ref, out = moe(x).float(), cm(x).float()
        assert torch.isfinite(ref).all()
        assert float((out - ref).abs().max() / ref.abs().max()) < TOL, T
    with torch.no_grad():
        moe.w2_scale[:, 0, 0] = 255  # output column 0 of every expert's w2 reads a NaN scale
    with pytest.raises(ValueError, match=r"weight 'w2_scale' holds the scale byte 0xFF \(NaN in E8M0\) at index "
                                         r"\[0, 0, 0\]"):
        mxmoe.compile(moe, target="cpu")
    form = cm.stored_forms["w2_scale"]  # where logical [:, 0, 0] lies in the stored (padded, swizzled) array
    marker = np.zeros(form.shape, np.uint8)
    marker[:, 0, 0] = 1
    stored = dict(cm.parameters, w2_scale=np.where(form.apply("marker", marker) == 1, np.uint8(255),
                                                   cm.parameters["w2_scale"]))
    x = inputs(2, moe.config.hidden, 5)
    ref, out = moe(x).float(), cm.with_parameters(stored)(x).float()
    assert torch.isnan(ref[:, 0]).all() and torch.isnan(out[:, 0]).all()
    assert torch.isfinite(out[:, 1:]).all()


# ------------------------------------------------------------- slots with no expert (expert parallelism)
def _grouped_module(op: str, T_k: int, E: int, N: int, K: int, bias: bool, layout: str = "cpu-mxfp4-blocksplit") -> str:
    """A module whose @main runs one hand-written grouped-matmul op of the blocksplit layout on its
    arguments (x, ids, w, s[, bias][, routing weights])."""
    glu = 'activation = "swiglu_oai", alpha = 1.702 : f32, interleaved = true, limit = 7.0 : f32, '
    xt = f"tensor<?x{K}xbf16>" if op != "grouped_matmul_combine" else f"tensor<?x{T_k}x{K}xbf16>"
    args = [f"%x: {xt}", f"%ids: tensor<?x{T_k}xi32>", f"%w: tensor<{E}x{N}x{K // 2}xi8>",
            f"%s: tensor<{E}x{N}x{K // 32}xi8>"] + ([f"%b: tensor<{E}x{N}xbf16>"] if bias else [])
    operands = ["%x", "%ids", "%w", "%s"] + (["%b"] if bias else [])
    if op == "grouped_matmul_combine":
        args.append(f"%rw: tensor<?x{T_k}xf32>")
        operands.append("%rw")
    rt = {"grouped_matmul": f"tensor<?x{T_k}x{N}xbf16>", "grouped_matmul_glu": f"tensor<?x{T_k}x{N // 2}xbf16>",
          "grouped_matmul_combine": f"tensor<?x{N}xbf16>"}[op]
    types = ", ".join(a.split(": ", 1)[1] for a in args)
    attrs = (glu if op == "grouped_matmul_glu" else "") + f'has_bias = {"true" if bias else "false"}, mxmoe.layout = "{layout}"'
    return (f"func.func @main({', '.join(args)}) -> {rt} {{\n"
            f'  %y = "mxmoe.{op}"({", ".join(operands)}) {{{attrs}}} : ({types}) -> {rt}\n'
            f"  return %y : {rt}\n}}\n")


def _compile_lowered(text: str, ukernel: str | None) -> bytes:
    from iree.compiler import compile_str

    from mxmoe.compiler.context import parse_module
    from mxmoe.compiler.passes import run_passes

    module = parse_module(text)
    run_passes(module, [("mxmoe-lower-to-linalg", f"ukernel={ukernel}" if ukernel else None)])
    return compile_str(str(module), extra_args=TARGETS["cpu"].iree_flags)


def _slots_reference(op, x, ids, w, s, b, rw):
    """The ops' meaning with the rule for slots with no expert: their matmul row is 0 (no bias), so a GLU
    row of them is glu(0, 0) = 0 and the combine adds nothing for them."""
    from mxmoe.core import mxfp4

    T, k = ids.shape
    E, N = w.shape[:2]
    xs = x.astype(np.float32)
    xs = xs if xs.ndim == 3 else np.broadcast_to(xs[:, None], (T, k, xs.shape[-1]))
    y = np.zeros((T, k, N), np.float32)
    for e in range(E):
        sel = ids == e
        y[sel] = xs[sel] @ mxfp4.dequantize(w[e], s[e]).T + (b[e].astype(np.float32) if b is not None else 0)
    y = y.astype(ml_dtypes.bfloat16).astype(np.float32)
    if op == "grouped_matmul":
        return y
    if op == "grouped_matmul_glu":
        gate, up = np.minimum(y[..., 0::2], 7.0), np.clip(y[..., 1::2], -7.0, 7.0)
        return (up + 1) * gate / (1 + np.exp(-1.702 * gate))
    return (y * rw[..., None]).sum(1)


ml_dtypes = pytest.importorskip("ml_dtypes")


@pytest.mark.parametrize("path", ["microkernel", "linalg", "rowmajor"])
@pytest.mark.parametrize("op", ["grouped_matmul", "grouped_matmul_glu", "grouped_matmul_combine"])
def test_slots_with_no_expert_contribute_nothing(path, op, request):
    """The dialect's rule for expert parallelism: a slot whose expert id is outside [0, E) (-1: "not on this
    rank") gets a matmul output row of zeros, no bias, and costs no work; the combine adds nothing for it.
    Hand-written ops through mxmoe-lower-to-linalg and iree-compile, the C microkernel, the linalg schedule
    and the row-major form (the ROCm targets' lowering, compiled here for the CPU), against a numpy
    reference that zeros those rows: an odd block count (K = 96), tokens with every slot off this rank, ids
    -1, E and larger, one token, and a call where no slot has an expert."""
    from mxmoe.core import mxfp4
    from mxmoe.core.swizzle import blocksplit_swizzle
    from mxmoe.runtime.iree_executor import IreeExecutor

    if path in ("linalg", "rowmajor"):
        request.getfixturevalue("linalg_matvec")
        obj = None
    else:
        obj = ukernels.matvec_object().path
        if obj is None:
            pytest.skip(f"no cpu microkernel here: {ukernels.matvec_object().reason}")
    E, N, K, k = 5, 192, 96, 3
    rng = np.random.default_rng(0)
    w, s = mxfp4.random_mxfp4(rng, (E, N, K), std=0.1)
    b = (0.5 * rng.standard_normal((E, N))).astype(ml_dtypes.bfloat16)
    layout = "mxfp4-rowmajor" if path == "rowmajor" else "cpu-mxfp4-blocksplit"
    fn = IreeExecutor(_compile_lowered(_grouped_module(op, k, E, N, K, True, layout), obj), {})
    for T, frac in ((1, 0.5), (7, 0.4), (33, 0.6), (4, 1.0), (9, 0.0)):
        ids = rng.integers(0, E, (T, k)).astype(np.int32)
        off = rng.random((T, k)) < frac
        ids[off] = rng.choice(np.array([-1, E, 1000, -7], np.int32), off.sum())
        if T == 7:
            ids[2] = -1  # a token with no slot on this rank
        xshape = (T, k, K) if op == "grouped_matmul_combine" else (T, K)
        x = rng.standard_normal(xshape).astype(ml_dtypes.bfloat16)
        rw = rng.random((T, k)).astype(np.float32)
        args = [x, ids, (w if path == "rowmajor" else blocksplit_swizzle(w)).view(np.int8), s.view(np.int8), b]
        if op == "grouped_matmul_combine":
            args.append(rw)
        (out,) = fn(*args)
        out = out.astype(np.float32)
        ref = _slots_reference(op, x, ids, w, s, b, rw)
        if op != "grouped_matmul_combine":
            assert (out[off] == 0).all(), (T, "rows of slots with no expert must be exactly zero")
        elif T == 7:
            assert (out[2] == 0).all()
        scale = max(float(np.abs(ref).max()), 1e-30)
        assert float(np.abs(out - ref).max()) / scale < TOL, (path, op, T)


def test_a_microkernel_path_with_a_comma_is_refused_in_one_line(monkeypatch, tmp_path):
    """The pass options are comma-separated, so a cache folder with a comma in its path cannot carry the object's
    path: the compile says so, naming the setting to change, instead of failing in the pass's option parser."""
    monkeypatch.setenv("MXMOE_CACHE_DIR", str(tmp_path / "a,b"))
    ukernels.matvec_object.cache_clear()
    try:
        if ukernels.matvec_object().path is None:
            pytest.skip(f"no cpu microkernel here: {ukernels.matvec_object().reason}")
        with pytest.raises(ValueError, match=r"may not contain a comma .*MXMOE_CACHE_DIR") as e:
            mxmoe.compile(MoE.random(PRESETS["tiny"], seed=1), target="cpu")
        assert "\n" not in str(e.value)
    finally:
        ukernels.matvec_object.cache_clear()
