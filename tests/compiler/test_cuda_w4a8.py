"""The w4a8 form of the cuda targets (``activations="mxfp8"``, issue #30 / #26 item 5): its kernels under Triton's
interpreter against ``numpy_reference(activations="mxfp8")``, the instruction mix of its sm_100 / sm_90 cubins
(nvdisasm as Triton ships it), the option's checks. On a GPU: tests/kernels/test_triton_w4a8_gpu.py."""

import collections
import os
import re
import subprocess

import ml_dtypes
import numpy as np
import pytest
import torch

import mxmoe
from mxmoe.compiler.targets import get_target
from mxmoe.core.config import MoEConfig
from mxmoe.core.reference import numpy_reference, relative_error
from mxmoe.torch_frontend import MoE

pytest.importorskip("iree.compiler")
from triton.runtime.interpreter import InterpreterBuilder  # noqa: E402

if not hasattr(InterpreterBuilder, "create_dot_scaled"):  # Triton < 3.7's interpreter
    pytestmark = pytest.mark.skip(reason="this Triton's interpreter has no tl.dot_scaled")

#: max |out - ref8| / max |ref8| against the mxfp8 reference. The kernels round where the reference does, so
#: what remains is the output's bf16 rounding: the interpreter's fp32 -> bf16 stores truncate (the slot rows and
#: the output: up to 2 bf16 ulps, 2^-6 of an element at the bottom of its binade) and fp32 sums in another order.
#: Measured 0.35-0.7% on N(0, 1) input, 1.2% with outliers (2 ulps of the largest output element).
TOL_MXFP8 = 2e-2
#: ... and against the bf16 reference: what MXFP8 activations cost (measured 6-8% on random layers, N(0, 1) input)
TOL_BF16 = 0.12


def _x(T, H, seed, outliers=False):
    """N(0, 1) hidden states; ``outliers``: a few values per row at 20-200x (real activations' massive dims)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    if outliers:
        cols = torch.randint(0, H, (T, 3), generator=g)
        x.scatter_(1, cols, torch.randn(T, 3, generator=g).sign() * torch.empty(T, 3).uniform_(20, 200, generator=g))
    return x.bfloat16()


def _errors(cm, layer, x, mx_fold="block"):
    """(error against the mxfp8 reference, with the target's fold: "row" on sm_90; against the bf16 reference)."""
    w = layer.to_weights()
    out = cm(x).float().numpy()
    xs = x.float().numpy()
    return (relative_error(out, numpy_reference(w, xs, ml_dtypes.bfloat16, activations="mxfp8", mx_fold=mx_fold)),
            relative_error(out, numpy_reference(w, xs, ml_dtypes.bfloat16)))


# name: (config, token counts, outliers, router tweak)
CASES = {
    # K off every tile (H = 96 < BLOCK_K 128, I = 160: a partial fold pair and a partial K step), gpt-oss
    # semantics; 1 / 5 / 70 tokens: gemv, decode, sparse (swapped operands on sm_100)
    "odd_k": (dict(num_experts=8, top_k=2, hidden=96, intermediate=160), [1, 5, 70], False, None),
    # top-k 3, gate|up halves, SiLU, no biases, hidden states with outliers
    "k3_outliers": (dict(num_experts=6, top_k=3, hidden=128, intermediate=96, activation="silu", interleaved=False,
                         bias=False, router_bias=False), [4, 33], True, None),
    # every token on expert 5 (slot 0): most row blocks of the other experts are empty
    "one_expert": (dict(num_experts=8, top_k=2, hidden=64, intermediate=64), [2, 20], False, "one"),
    # scale bytes spread over 15 binades within a row: the sm_90 decode's table at every shift, and its zeros for
    # groups more than 11 binades under their row's largest scale
    "wide_scales": (dict(num_experts=4, top_k=2, hidden=256, intermediate=192), [3, 40, 300], False, "wide"),
}


@pytest.mark.parametrize("target", ["cuda:sm_100", "cuda:sm_90"])
@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_w4a8_matches_the_mxfp8_reference(case, target, widen_scales):
    cfg_kw, tokens, outliers, tweak = CASES[case]
    layer = MoE.random(MoEConfig(**cfg_kw), seed=3)
    if tweak == "one":
        with torch.no_grad():
            layer.router_bias[5] += 100.0
    elif tweak == "wide":
        widen_scales(layer)
    cm = mxmoe.compile(layer, target=target, activations="mxfp8", interpret=True)
    assert cm.kernel_plan["options"]["activations"] == "mxfp8"
    assert cm.target.record(cm.code)["activations"] == "mxfp8"
    fold = "row" if target == "cuda:sm_90" else "block"
    for T in tokens:
        e8, e16 = _errors(cm, layer, _x(T, layer.config.hidden, seed=T, outliers=outliers), fold)
        assert e8 <= TOL_MXFP8 and e16 <= TOL_BF16, (T, e8, e16)


def test_interpreted_sm90_w4a8_promotes_its_sums_every_few_k_steps(monkeypatch):
    """sm_90: partial sums of PROMOTE K steps added to the fp32 accumulator (Hopper's fp8 MMA sums with fewer bits);
    groups of 2 and 3 steps where K has 1 and 2 steps (a group's tail past K reads no activation bytes)."""
    from mxmoe.kernels.triton import tile_config

    monkeypatch.setattr(tile_config, "W4A8_PROMOTE_SM90", {"gemv": 2, "decode": 3, "sparse": 1})
    layer = MoE.random(MoEConfig(num_experts=8, top_k=2, hidden=96, intermediate=160), seed=4)
    cm = mxmoe.compile(layer, target="cuda:sm_90", activations="mxfp8", interpret=True)
    promote = {name: e["constexprs"]["PROMOTE"] for name, e in cm.kernel_plan["kernels"].items() if "w4a8" in name}
    assert promote["glu_gemm_w4a8.gemv"] == 2 and promote["combine_gemm_w4a8.decode"] == 3
    assert promote["combine_gemm_w4a8.sparse"] == 1 and promote["combine_gemm_w4a8.mid"] == 0
    for T in (1, 5, 70):
        e8, e16 = _errors(cm, layer, _x(T, 96, seed=T, outliers=True), "row")
        assert e8 <= TOL_MXFP8 and e16 <= TOL_BF16, (T, e8, e16)


def test_interpreted_w4a8_prefill_tile_on_sm100():
    """Past 1024 tokens the sm_100 plan puts 128 token rows first in the block-scaled MMA (no operand swap)."""
    layer = MoE.random(MoEConfig(num_experts=8, top_k=2, hidden=64, intermediate=64), seed=1)
    cm = mxmoe.compile(layer, target="cuda:sm_100", activations="mxfp8", interpret=True)
    prefill = next(c for c in cm.kernel_plan["classes"] if c["name"] == "prefill")
    glu = next(cm.kernel_plan["kernels"][lc["kernel"]] for lc in prefill["launches"] if "glu" in lc["kernel"])
    assert glu["constexprs"]["BLOCK_M"] == 128 and not glu["constexprs"]["SWAP_AB"]
    e8, e16 = _errors(cm, layer, _x(1100, 64, seed=5, outliers=True))
    assert e8 <= TOL_MXFP8 and e16 <= TOL_BF16, (e8, e16)


def test_quantizer_is_the_reference_rounding():
    """The in-kernel MXFP8 quantizer gives the reference's bits (FOLD=1). In the sm_90 form (a whole row folded onto
    its largest scale, bytes in the Hopper loop's K-step order, rows padded to whole steps with zeros) it gives
    ``mxfp8_row_round_trip``'s bits, which move a value by at most 2^-10 of the row's scale (an e4m3 subnormal
    half-step) from its MXFP8 value."""
    from mxmoe.core import mxfp4
    from mxmoe.kernels.triton._w4a8_kernels import hopper_a_stride
    from mxmoe.kernels.triton.kernels import get_kernel, interpreter_scope

    g = torch.Generator().manual_seed(0)
    R, C = 37, 160
    x = torch.randn(R, C, generator=g) * torch.exp(torch.randn(R, C, generator=g) * 3)
    x[3, 5], x[4, :32], x[5, 40] = 1000.0, 0.0, 31.75 * 2.0 ** -6  # saturation, an empty block, a carry tie
    ref = mxfp4.mxfp8_round_trip(x.numpy())
    kernel = get_kernel("mxfp8_quant", interpret=True)
    q, s = torch.zeros(R, C, dtype=torch.uint8), torch.zeros(R, C // 32, dtype=torch.uint8)
    with interpreter_scope():
        kernel[(3, 2)](x, q, s, R, C, 1, 16, 128)
    scale = np.repeat(2.0 ** (s.numpy().astype(np.float32) - 127), 32, axis=1)
    assert np.array_equal(q.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale, ref)

    step = 128
    stride = hopper_a_stride(C, step)
    q = torch.full((R, stride), 0x55, dtype=torch.uint8)
    with interpreter_scope():
        kernel[(R // 4 + 1, 1)](x, q, s, R, C, 8, 4, 256, step)
    # column c of a step sits at (c % 8) // 4 * step / 2 + c // 8 * 4 + c % 4 of it
    r = np.arange(stride) % step
    where = np.arange(stride) - r + (r % 8) // 4 * (step // 2) + r // 8 * 4 + r % 4
    got = q.numpy()[:, where]
    assert np.all(got[:, C:] == 0)
    scale = np.repeat(2.0 ** (s.numpy().astype(np.float32) - 127), 32, axis=1)
    assert np.all(s.numpy() == s.numpy()[:, :1])
    vals = got[:, :C].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    assert np.array_equal(vals, mxfp4.mxfp8_row_round_trip(x.numpy()))
    assert np.all(np.abs(vals - ref) <= scale * 2.0 ** -10)
    assert np.abs(vals - ref).max() > 0  # the fold does move the smallest values of the far-below blocks


def test_w4a8_option_checks():
    assert get_target("cuda:sm_90").with_activations("mxfp8").layout.name == "mxfp4-rowmajor"
    assert get_target("cuda:sm_90").with_activations("mxfp8").with_activations("bf16") == get_target("cuda:sm_90")
    with pytest.raises(ValueError, match="activations must be one of bf16, mxfp8, got 'fp4'"):
        get_target("cuda:sm_100").with_activations("fp4")
    with pytest.raises(ValueError, match="has no batch-invariant form"):
        mxmoe.compile(MoE.random(MoEConfig(num_experts=4, top_k=2, hidden=64, intermediate=64), seed=0),
                      target="cuda:sm_100", activations="mxfp8", batch_invariant=True, interpret=True)


# ------------------------------------------------------------------------------------------- SASS
def _nvdisasm() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(path):
        pytest.skip("this Triton ships no nvdisasm")
    return path


def _opcodes(cubin: bytes, tmp_path, name: str) -> collections.Counter:
    """SASS opcodes with their modifiers (``F2FP.BF16.F32.PACK_AB``) and bare (``F2FP``), counted."""
    path = tmp_path / f"{name}.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([_nvdisasm(), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)", text):
        ops[m.group(1)] += 1
        ops[m.group(1) + m.group(2)] += 1 if m.group(2) else 0
    return ops


#: a layer with every class (E=8, k=2: sparse to 128 tokens, prefill to 2047, then large) and the native tiles' sizes
SASS_LAYER = dict(num_experts=8, top_k=2, hidden=256, intermediate=256)


@pytest.mark.parametrize("arch", [100, 90])
def test_w4a8_cubins_use_the_native_mma(arch, tmp_path):
    """sm_100: every expert GEMM of every class is the block-scaled tcgen05 MMA (``UTCQMMA``: e4m3 x e2m1 with both
    scale tiles read by the tensor core), with no bf16/f16 MMA (``UTCHMMA``, ``HMMA``) and no e2m1 upcast
    (``F2FP`` unpacking E2M1); its only F2FP pack the GLU output to e4m3 (and round it to bf16 first). sm_90:
    fp8 wgmma (``QGMMA``), no bf16 wgmma (``HGMMA``), the weight decode by ``PRMT`` with no e4m3 conversion; no
    register spills in either."""
    layer = MoE.random(MoEConfig(**SASS_LAYER), seed=0)
    cm = mxmoe.compile(layer, target=f"cuda:sm_{arch}", activations="mxfp8")
    plan = cm.kernel_plan
    assert {c["name"] for c in plan["classes"]} >= {"mid", "prefill", "large"}
    gemms = {lc["kernel"] for c in plan["classes"] for lc in c["launches"]
             if plan["kernels"][lc["kernel"]]["kernel"] in ("glu_gemm_w4a8", "combine_gemm_w4a8")}
    assert len(gemms) >= 8
    for name in sorted(gemms):
        ops = _opcodes(cm.binaries[name], tmp_path, name)
        assert ops["STL"] == 0 and ops["LDL"] == 0, (name, ops["STL"])
        if arch == 100:
            assert ops["UTCQMMA"] > 0 and ops["UTCHMMA"] == ops["HMMA"] == ops["UTCOMMA"] == 0, (name, ops)
        else:  # the weights decoded by byte-table lookups, not through a float conversion
            assert ops["QGMMA"] > 0 and ops["HGMMA"] == 0 and ops["PRMT"] > 0, (name, ops)
            assert not any(op.startswith("F2FP") and "E4M3" in op for op in ops), (name, ops)
        upcasts = [op for op in ops if op.startswith("F2FP.") and "E2M1" in op]
        packs = {op for op in ops if op.startswith("F2FP.")} - set(upcasts)
        assert not upcasts and packs <= {"F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C", "F2FP.BF16.F32.PACK_AB",
                                          "F2FP.F16.E4M3.UNPACK_B"}, (name, packs, upcasts)


def test_w4a8_runs_every_entry_and_refuses_what_it_lacks():
    """The w4a8 form of the monolithic and modular entries (an expert map, ids outside the layer, a sigmoid router)
    against the mxfp8 reference; router weight on input, a shared expert and gelu are not in its GEMMs yet: one-line
    errors naming them."""
    from mxmoe.compiler.triton_plan import TritonPlanError

    cfg = MoEConfig(num_experts=8, top_k=3, hidden=64, intermediate=96, global_num_experts=12,
                    routing="sigmoid_topk", renormalize=True, routed_scaling_factor=2.0, activation="silu",
                    interleaved=False)
    layer = MoE.random(cfg, seed=2)
    cm = mxmoe.compile(layer, target="cuda:sm_90", activations="mxfp8", interpret=True, entries="all")
    w8, x = layer.to_weights(), _x(9, 64, seed=1)
    xs, bf16 = x.float().numpy(), ml_dtypes.bfloat16
    logits = _x(9, 12, seed=2)
    out = cm.entry("monolithic")(x, logits).float().numpy()
    ref = numpy_reference(w8, xs, bf16, entry="monolithic", router_logits=logits.float().numpy(), activations="mxfp8")
    assert relative_error(out, ref) <= TOL_MXFP8
    tw = torch.rand(9, 3, generator=torch.Generator().manual_seed(3)) + 0.1
    ids = torch.randint(-1, 13, (9, 3), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    ids[0] = torch.tensor([0, 1, 2])
    out = cm.entry("modular")(x, tw, ids).float().numpy()
    ref = numpy_reference(w8, xs, bf16, entry="modular", topk_weights=tw.numpy(), topk_ids=ids.numpy(),
                          activations="mxfp8")
    assert relative_error(out, ref) <= TOL_MXFP8
    for kw, what in ((dict(top_k=1, apply_router_weight_on_input=True), "router weight on input"),
                     (dict(shared_intermediate=64), "a shared expert"), (dict(activation="gelu"), "activation 'gelu'")):
        other = MoE.random(MoEConfig(**{**dict(num_experts=8, top_k=2, hidden=64, intermediate=64), **kw}), seed=0)
        with pytest.raises(TritonPlanError, match=f"activations='mxfp8' does not run {what} yet"):
            mxmoe.compile(other, target="cuda:sm_90", activations="mxfp8", interpret=True)
