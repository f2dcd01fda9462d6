"""``mxmoe.compile`` for cuda targets without a GPU: the kernel plan, AOT cubins for sm_90 and sm_100,
and the plan's kernels run under Triton's interpreter against the reference ``MoE`` forward."""

import json

import pytest
import torch

import mxmoe
from mxmoe.core.config import MoEConfig
from mxmoe.torch_frontend import MoE

pytest.importorskip("iree.compiler")
from triton.runtime.interpreter import InterpreterBuilder  # noqa: E402

if not hasattr(InterpreterBuilder, "create_dot_scaled"):  # Triton < 3.7's interpreter
    pytestmark = pytest.mark.skip(reason="this Triton's interpreter has no tl.dot_scaled")


def _cfg(E=8, k=2, H=64, I=96, **kw):
    return MoEConfig(num_experts=E, top_k=k, hidden=H, intermediate=I, **kw)


def _check(out: torch.Tensor, ref: torch.Tensor, skip: torch.Tensor | None = None) -> None:
    """bf16-level agreement: the reference rounds each op's result to the activation dtype, the
    kernels keep fp32 until the GLU output and the final sum. ``skip`` (bool per token): tokens at a
    routing near-tie, which may legitimately pick another expert (at most 5% of them)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    assert torch.isfinite(out).all()
    scale = ref.abs().max().item()
    assert scale > 0.05, "reference output is degenerate"
    err = (out - ref).abs()
    bad = (err > 0.02 * scale + 0.02 * ref.abs()).any(dim=-1)
    if skip is not None:
        assert int(skip.sum()) <= max(1, out.shape[0] // 20), f"{int(skip.sum())} near-tie tokens"
        bad &= ~skip.reshape(-1)
    assert not bad.any(), f"max err {err[bad].max().item():.4g} (scale {scale:.3g}) at {int(bad.sum())} token(s)"


def _x(T, H, dtype=torch.bfloat16, seed=0, shape=None):
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.reshape(shape) if shape is not None else x


# name: (config, dtype, token counts, router-bias tweak)
CASES = {
    # gpt-oss semantics; T=70 is the "sparse" tile class (BLOCK_M=32), T=200 "mid" (BLOCK_M=64), the rest
    # gemv and decode
    "gpt_oss_k2": (_cfg(), torch.bfloat16, [1, 5, 70, 200], None),
    # K not a multiple of the tile (H=96 < BLOCK_K=128, I=160 < 256), top_k=4, no biases,
    # renormalised softmax-then-top-k, plain SiLU-GLU, gate/up concatenated
    "k4_silu_concat_nobias": (_cfg(H=96, I=160, k=4, routing="softmax_topk", renormalize=True, activation="silu",
                                   interleaved=False, bias=False, router_bias=False), torch.bfloat16, [1, 17], None),
    "k1_softmax_topk": (_cfg(k=1, routing="softmax_topk"), torch.bfloat16, [1, 33], None),
    "fp32_activations": (_cfg(activation="silu"), torch.float32, [4], None),
    # T=2 (gemv class, the combine casts its own tiles): both tokens on expert 5, so row blocks stay empty
    "all_tokens_one_expert": (_cfg(k=2), torch.bfloat16, [2, 20], "one"),
    "experts_without_tokens_k1": (_cfg(k=1), torch.bfloat16, [9], "odd_off"),
    # H = 640: the few-token router splits H over 5 programs whose last one routes its 16-token block; at 40
    # tokens three blocks, the last one routed sorts all pairs (router_route_group: 8 experts)
    "router_split_over_h": (_cfg(H=640, k=4), torch.bfloat16, [1, 4, 9, 40], None),
    # 128 experts: at 1-4 tokens the last block sorts 16 pairs a step (router_route_group); at 5-64 every
    # token block counts its pairs and the last one routed scatters (router_route_scatter; 40 tokens: three
    # blocks, 16 tokens: one); the router 8 warps (fp32: with 128 bf16 logits a token's 4th and 5th are often
    # within an ulp)
    "many_experts_grouping_steps": (_cfg(E=128, k=4, H=256), torch.float32, [3, 16, 40], None),
}


def _layer(cfg, dtype, tweak):
    layer = MoE.random(cfg, seed=3, dtype=dtype)
    with torch.no_grad():
        if tweak == "one":
            layer.router_bias[5] += 100.0  # expert 5 takes every token (slot 0); others share slot 1
        elif tweak == "odd_off":
            layer.router_bias[1::2] -= 100.0  # odd experts never chosen
    return layer


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_module_matches_reference(name, near_tie_tokens):
    cfg, dtype, tokens, tweak = CASES[name]
    layer = _layer(cfg, dtype, tweak)
    cm = mxmoe.compile(layer, target="cuda:sm_90", interpret=True)
    assert cm.binaries == {} and cm.kernel_plan["layer"]["top_k"] == cfg.top_k
    for T in tokens:
        x = _x(T, cfg.hidden, dtype, seed=T)
        if tweak == "one":
            ids = torch.ops.mxmoe.route(torch.nn.functional.linear(x, layer.router_weight, layer.router_bias),
                                        cfg.top_k, cfg.routing, cfg.renormalize)[1]
            assert bool((ids[:, 0] == 5).all())
        logits = torch.nn.functional.linear(x, layer.router_weight, layer.router_bias)
        _check(cm(x), layer(x), near_tie_tokens(logits, cfg.top_k))


def test_prefill_class_and_batched_input(near_tie_tokens):
    """Past 128 rows per expert (T * k / E; 512 tokens here) sm_90 runs the prefill tiles (BLOCK_M=128), from 160
    the large ones (BLOCK_M=256, grouped launch order); a [B, S, H] input comes back as [B, S, H]."""
    cfg = _cfg(E=8, k=2, H=64, I=64)
    layer = MoE.random(cfg, seed=1)
    x3 = _x(2 * 3, 64, shape=(2, 3, 64))
    cm = mxmoe.compile(layer, target="cuda:sm_90", example_inputs=(x3,), interpret=True)
    _check(cm(x3), layer(x3))
    # at ~1000+ tokens of a 64-wide router some tokens sit at exact bf16 ties of their 2nd and 3rd logit
    def ties(x):
        return near_tie_tokens(torch.nn.functional.linear(x, layer.router_weight, layer.router_bias).reshape(
            -1, cfg.num_experts), cfg.top_k)

    x = _x(600, 64, seed=2).reshape(2, 300, 64)
    assert cm.kernel_plan["classes"][5]["name"] == "prefill" and cm.kernel_plan["classes"][5]["max_tokens"] >= 600
    _check(cm(x), layer(x), ties(x))
    x = _x(2100, 64, seed=3)  # the "large" class: 256-row tiles in grouped launch order
    _check(cm(x), layer(x), ties(x))


@pytest.mark.parametrize("target", ["cuda:sm_90", "cuda:sm_100"])
def test_plan_is_plain_data_with_classes_and_parameter_bindings(target):
    layer = MoE.random(_cfg(), seed=0)
    cm = mxmoe.compile(layer, target=target, interpret=True)
    plan = json.loads(json.dumps(cm.kernel_plan))
    assert plan == cm.kernel_plan
    hopper = target == "cuda:sm_90"
    assert plan["layer"]["layout"] == ("triton-mxfp4-hopper-tiled" if hopper else "mxfp4-rowmajor")
    # sparse up to 32 rows per expert (T * k / E <= 32), large from 512, with E = 8, k = 2; on sm_90 mid's range ends
    # at 128 rows per expert, past 96 on 128-row tiles (mid_wide), and large starts at 160
    names = ["gemv", "decode", "sparse", "mid", "mid_wide", "prefill", "large"]
    bounds = [4, 64, 128, 384, 512, 639, None]
    if not hopper:
        names, bounds = names[:4] + names[5:], [4, 64, 128, 1024, 2047, None]
    assert [c["name"] for c in plan["classes"]] == names
    assert [c["max_tokens"] for c in plan["classes"]] == bounds
    sparse = plan["classes"][2]["tiles"]
    assert sparse["w13"]["BLOCK_M"] == sparse["w2"]["BLOCK_M"] == 32
    large = plan["classes"][-1]["tiles"]
    assert large["w13"]["BLOCK_M"] == large["w2"]["BLOCK_M"] == 256 and large["w13"]["GROUP_M"] == 4
    # every weight global feeds a kernel, and every parameter a kernel reads is a compiled parameter
    fed = {a["ref"] for k in plan["kernels"].values() for a in k["args"] if a["bind"] == "param"}
    assert fed == set(plan["parameters"]) == set(cm.parameters)
    for name, spec in plan["parameters"].items():
        assert list(cm.parameters[name].shape) == spec["shape"]
    for decode in plan["classes"][:2]:  # gemv and decode: few tokens, one-program grouping
        assert decode["tiles"]["w13"]["BLOCK_M"] == decode["tiles"]["w2"]["BLOCK_M"] == 16
        kernels = [plan["kernels"][launch["kernel"]]["kernel"] for launch in decode["launches"]]
        # both: one launch routes and groups (router_route_group); gemv: the combine casts its finished tiles
        # itself (no cast launch; its counts take one more accumulator row), and does not split K (I = 96: one step);
        # decode: a cast launch
        fused = decode["name"] == "gemv"
        assert kernels == ["router_route_group", "glu_gemm", "combine_gemm"] + ([] if fused else ["cast"])
        comb_launch = next(lc for lc in decode["launches"] if plan["kernels"][lc["kernel"]]["kernel"] == "combine_gemm")
        comb = plan["kernels"][comb_launch["kernel"]]
        assert comb["constexprs"]["FUSED_CAST"] is fused
        split = 1
        assert comb["constexprs"]["SPLIT_K"] == split and comb_launch["grid"][2:] == [split]
        # the router: 64-wide H (H = 64) in one step; the sort's steps: the class's most pairs (4 or 64
        # tokens x k = 2, at least 16), at most 4096 one-hot entries (8 experts: 256)
        router = plan["kernels"][decode["launches"][0]["kernel"]]
        assert router["constexprs"]["H_PER_SPLIT"] == router["constexprs"]["BLOCK_H"] == 64
        assert router["constexprs"]["CHUNK"] == (16 if fused else 128) and router["num_warps"] == 4
    # the accumulator's rows per class: the gemv class's counters take one more
    assert plan["buffers"]["accumulator"]["shape"] == ["ACC", 64]
    assert [c["vars"]["ACC"] for c in plan["classes"]] == ["T + 1"] + ["T"] * (len(names) - 1)
    gemms = [plan["kernels"][lc["kernel"]]["constexprs"] for cls in plan["classes"] for lc in cls["launches"]
             if plan["kernels"][lc["kernel"]]["kernel"].endswith("_gemm")
             and plan["kernels"][lc["kernel"]]["kernel"] != "router_gemm"]
    # sm_90 decodes the Hopper layout in registers (no TMA, one multiply: the random scales are <= 128);
    # sm_100 feeds the checkpoint order to dot_scaled, TMA weight tiles from the decode class on
    assert all(c["W_HOPPER"] is hopper for c in gemms)
    assert all(c["WIDE_SCALES"] is False for c in gemms if hopper)
    decode_tma = [c["W_TMA"] for c in gemms[2:4]]
    assert decode_tma == ([False, False] if hopper else [True, True])
    # past 1024 tokens (sm_100's prefill, sm_90's large: its prefill ends at 639 tokens, which split the router)
    many = plan["classes"][-1 if hopper else names.index("prefill")]
    kernels = [plan["kernels"][launch["kernel"]]["kernel"] for launch in many["launches"]]
    # many tokens: router and routing in one launch (the few-token router's chunks of H: issue #22), grouping
    assert kernels == ["router_route", "chunk_histogram", "chunk_scan", "chunk_scatter", "glu_gemm", "combine_gemm",
                       "cast"]
    router = plan["kernels"][many["launches"][0]["kernel"]]["constexprs"]
    assert router["H_PER_SPLIT"] == router["BLOCK_H"] == 64 and router["ROUTER_BLOCK_T"] == 16
    assert plan["kernels"][many["launches"][-2]["kernel"]]["constexprs"]["FUSED_CAST"] is False


def test_decode_class_with_many_experts_groups_from_block_counts():
    """128 experts: the decode class's router launch groups from per-token-block counts, the gemv class's
    sorts in its one block; with 8 experts both sort; 64 experts with top-8 group from counts too
    (``kernels.triton.planner.few_token_scatter``)."""
    def router_kernels(E, k=4):
        plan = mxmoe.compile(MoE.random(_cfg(E=E, k=k, H=256), seed=0), target="cuda:sm_90",
                             interpret=True).kernel_plan
        return {c["name"]: plan["kernels"][c["launches"][0]["kernel"]]["kernel"] for c in plan["classes"][:2]}

    assert router_kernels(128) == {"gemv": "router_route_group", "decode": "router_route_scatter"}
    assert router_kernels(8) == {"gemv": "router_route_group", "decode": "router_route_group"}
    # 64 experts: top-8 (64 tokens x 8 slots x 64 experts one-hot entries to sort) groups from counts, top-4 sorts
    assert router_kernels(64, 8)["decode"] == "router_route_scatter"
    assert router_kernels(64, 4)["decode"] == "router_route_group"


@pytest.mark.parametrize("target,arch", [("cuda:sm_90", 90), ("cuda:sm_100", 100)])
def test_aot_compiles_every_plan_kernel(target, arch):
    layer = MoE.random(_cfg(H=96, I=160), seed=0)
    cm = mxmoe.compile(layer, target=target)
    plan = cm.kernel_plan
    assert plan["arch"] == arch and plan["target"] == target
    assert set(cm.binaries) == set(plan["kernels"]) == set(plan["cubins"])
    for name, blob in cm.binaries.items():
        assert isinstance(blob, bytes) and blob[:4] == b"\x7fELF", name
        meta = plan["cubins"][name]
        assert meta["function"].encode() in blob, (name, meta["function"])
        assert meta["num_warps"] == plan["kernels"][name]["num_warps"]
    launched = {launch["kernel"] for cls in plan["classes"] for launch in cls["launches"]}
    assert launched == set(plan["kernels"])


def test_calling_a_cuda_module_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    cm = mxmoe.compile(MoE.random(_cfg(), seed=0), target="cuda:sm_90", interpret=True)
    cm.code.interpret = False
    with pytest.raises(RuntimeError, match="needs an NVIDIA Hopper GPU"):
        cm(_x(2, 64))


def test_bad_inputs_give_clear_errors():
    cm = mxmoe.compile(MoE.random(_cfg(), seed=0), target="cuda:sm_90", interpret=True)
    with pytest.raises(ValueError, match=r"expected \[T, 64\]"):
        cm(_x(3, 32))
    with pytest.raises(ValueError, match="expected bfloat16"):
        cm(torch.ones(3, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="expected 1 input"):
        cm(_x(3, 64), _x(3, 64))
    with pytest.raises(ValueError, match="interpret=True applies to cuda targets only"):
        mxmoe.compile(MoE.random(_cfg(), seed=0), target="cpu", interpret=True)


class _Residual(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return x + self.moe(x)


def test_graph_with_other_torch_ops_is_refused_naming_them():
    from mxmoe.compiler.triton_plan import TritonPlanError

    layer = MoE.random(_cfg(), seed=0)
    with pytest.raises(TritonPlanError, match=r"no kernels for: torch\.aten\.add\.Tensor"):
        mxmoe.compile(_Residual(layer), target="cuda:sm_90", example_inputs=(_x(4, 64),), interpret=True)


def test_plan_expressions_reject_code():
    from mxmoe.kernels.triton.expr import ExprError, evaluate

    assert evaluate("cdiv(T * 4, 16) + min(8, T * 4)", {"T": 5}) == 2 + 8
    for bad in ("__import__('os')", "T.real", "T ** 2", "1.5 * T", "lambda: 1"):
        with pytest.raises(ExprError):
            evaluate(bad, {"T": 1})
    with pytest.raises(ExprError, match="unknown name 'NB'"):
        evaluate("NB + 1", {"T": 1})


_INTERPRET_PROCESS = """
import torch, mxmoe
from mxmoe.core.config import MoEConfig
from mxmoe.torch_frontend import MoE
layer = MoE.random(MoEConfig(num_experts=4, top_k=2, hidden=64, intermediate=64), seed=0)
cm = mxmoe.compile(layer, target="cuda:sm_90")              # AOT must leave this process (interpreted tl)
assert cm.binaries and all(b[:4] == b"\\x7fELF" for b in cm.binaries.values())
cm = mxmoe.compile(layer, target="cuda:sm_90", interpret=True)
x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
ref = layer(x).float()
err = ((cm(x).float() - ref).abs().max() / ref.abs().max()).item()
assert err < 2e-2, err
print("ok", len(cm.kernel_plan["kernels"]))
"""


def test_process_started_with_triton_interpret_set():
    """With TRITON_INTERPRET=1 in the environment from the start, Triton's own helpers are interpreted:
    interpret runs work directly and AOT compilation moves to a subprocess without the variable."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRET_PROCESS], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("ok")


def test_old_tritons_compile_the_prefill_gemms_unpipelined():
    """Triton 3.6 miscompiled the pipelined prefill GEMMs on an H100 (see tile_config.compile_stages)."""
    from mxmoe.kernels.triton.tile_config import compile_stages

    prefill = {"BLOCK_M": 128}
    assert compile_stages("glu_gemm", prefill, 4, "3.6.0") == 1
    assert compile_stages("combine_gemm", prefill, 4, "3.8.1+git") == 1
    assert compile_stages("glu_gemm", prefill, 4, "3.9.0") == 4
    assert compile_stages("glu_gemm", {"BLOCK_M": 64}, 4, "3.6.0") == 4
    assert compile_stages("route", prefill, 4, "3.6.0") == 4
    # the Hopper path: pipelined at most K-loop trips - 1 deep on old Tritons (an MXFP4 shared expert's w2 GEMM with
    # I = 256, BLOCK_K = 64, 4 stages gave wrong rows with Triton 3.6)
    shared_w2 = {"W_HOPPER": True, "BLOCK_M": 256, "BLOCK_K": 64, "INTERMEDIATE": 256, "HIDDEN": 384, "SPLIT_K": 1}
    assert compile_stages("combine_gemm", shared_w2, 4, "3.6.0") == 3
    assert compile_stages("combine_gemm", shared_w2, 4, "3.9.0") == 4
    assert compile_stages("combine_gemm", {**shared_w2, "INTERMEDIATE": 320}, 4, "3.6.0") == 4
    assert compile_stages("glu_gemm", shared_w2, 4, "3.6.0") == 4  # K = H = 384: 6 trips
    # mid_wide (128 token rows, 64-row tails) gave a few wrong rows a call with Triton 3.6 at 3-4 stages: 2 there
    mid_wide = {"W_HOPPER": True, "BLOCK_M": 128, "TAIL_M": 64, "BLOCK_K": 64, "INTERMEDIATE": 768, "HIDDEN": 512}
    assert compile_stages("glu_gemm", mid_wide, 4, "3.6.0") == 2
    assert compile_stages("combine_gemm", mid_wide, 4, "3.6.0") == 2
    assert compile_stages("glu_gemm", mid_wide, 4, "3.9.0") == 4
    assert compile_stages("glu_gemm", {**mid_wide, "TAIL_M": 0}, 4, "3.6.0") == 4  # prefill: right at 4 stages
    assert compile_stages("glu_gemm", {**mid_wide, "BLOCK_M": 256, "TAIL_M": 128}, 3, "3.6.0") == 3  # large
    assert compile_stages("combine_gemm", {**shared_w2, "BLOCK_K": 256, "SPLIT_K": 2, "INTERMEDIATE": 512}, 3,
                          "3.6.0") == 1


def test_scale_range_picks_the_hopper_decode_and_the_executor_holds_weights_to_it():
    """Scale bytes <= 128 let the sm_90 decode multiply once per value pair; a layer with a larger one (here a
    block of weights up to 6 * 2^73) keeps the two-multiply form and still matches the reference; a plan made
    for small scales refuses weights it was not compiled for instead of returning infinities."""
    from mxmoe.runtime.triton_executor import TritonExecutor
    from mxmoe.kernels.triton.kernel_plan import PlanError

    def hopper_flags(cm):
        return {e["constexprs"]["WIDE_SCALES"] for e in cm.kernel_plan["kernels"].values()
                if e["constexprs"].get("W_HOPPER")}

    layer = MoE.random(_cfg(), seed=0)
    small = mxmoe.compile(layer, target="cuda:sm_90", interpret=True)
    assert hopper_flags(small) == {False}
    with torch.no_grad():
        layer.w2_scale[3, 5, 1] = 200  # one 32-value block of expert 3's w2 row 5, scaled by 2^73
        layer.w2_bias.zero_()
    wide = mxmoe.compile(layer, target="cuda:sm_90", interpret=True)
    assert hopper_flags(wide) == {True}
    x = _x(9, 64, seed=4)
    out, ref = wide(x), layer(x)
    hit = torch.isinf(ref.float()) | (ref.float().abs() > 1e15)  # tokens routed to expert 3 see the huge row
    assert hit.any() and hit.sum() < hit.numel() // 8
    # one 32-term dot dominates these outputs, so cancellation in it shows more than elsewhere
    torch.testing.assert_close(out.float()[hit], ref.float()[hit], rtol=5e-2, atol=0)
    assert torch.equal(torch.isinf(out.float()), torch.isinf(ref.float()))
    _check(torch.where(hit, 0, out.float()), torch.where(hit, 0, ref.float()))
    params = {g: (wide.parameters[g] if spec["role"] == "scales" else small.parameters[g])
              for g, spec in small.kernel_plan["parameters"].items()}
    with pytest.raises(PlanError, match="scale byte 200 > 128"):
        TritonExecutor(small.kernel_plan, params, mode="interpret")


def test_router_chunks_are_summed_outside_the_mma():
    """Every router dot starts from the one runtime zero (kernels/triton/_routing_kernel.py ``_runtime_zero``), never
    from a running sum: Triton folds ``acc + dot(x, w, 0)`` into ``dot(x, w, acc)``, which on a GPU gave the
    many-token classes other logits than the few-token ones (a token's experts then depended on its batch). Read
    from the TTGIR Triton makes for sm_90, so it fails here, without a GPU, if the fold comes back."""
    import re

    from mxmoe.kernels.triton.aot import compile_entry
    from mxmoe.kernels.triton.kernel_plan import KernelPlan

    plan = mxmoe.compile(MoE.random(_cfg(E=16, k=3, H=320), seed=0), target="cuda:sm_90", interpret=True).kernel_plan
    kp = KernelPlan.from_dict(plan)
    routers = [n for n, k in plan["kernels"].items() if k["kernel"].startswith("router")]
    assert {plan["kernels"][n]["kernel"] for n in routers} >= {"router_route", "router_route_group"}
    for name in routers:
        ttgir = compile_entry(kp, name, 90).asm["ttgir"]
        accs = re.findall(r"= tt\.dot %[\w.]+, %[\w.]+, (%[\w.]+)", ttgir)
        assert accs, name
        assert len(set(accs)) == 1 and not accs[0].startswith("%arg"), (name, accs)
        init = re.search(rf"{re.escape(accs[0])} = (\S+)", ttgir).group(1)
        assert init in ("arith.addf", "tt.splat"), (name, init)  # the runtime zero: not a constant, not a loop value


# ------------------------------------------------------------------ the fused-MoE interface (issue #23)

def test_entries_plans_and_artifact(tmp_path):
    """One module, one plan per entry over one weight set: the layer entry's router, the monolithic entry routing
    the engine's logits (no router), the modular entry mapping the engine's ids (map_and_group for few tokens,
    map_ids + the chunked grouping for many), the shared expert's launches (gate, dense groups, its GEMMs) and
    router weight on input (the w13 GEMM scales its rows, the combine's weights are 1); the artifact keeps every
    entry and runs each after a load (interpreted here)."""
    from mxmoe.runtime import load
    from mxmoe.runtime.artifact import Artifact

    cfg = _cfg(E=8, k=1, global_num_experts=12, apply_router_weight_on_input=True, shared_intermediate=64,
               shared_gate=True)
    layer = MoE.random(cfg, seed=5)
    cm = mxmoe.compile(layer, target="cuda:sm_90", interpret=True, entries="all")
    plans = cm.code.plans
    assert list(plans) == ["layer", "monolithic", "modular"] and cm.kernel_plan is plans["layer"]

    def kernels(plan, cls):
        c = next(c for c in plan["classes"] if c["name"] == cls)
        return [plan["kernels"][lc["kernel"]]["kernel"] for lc in c["launches"]]

    shared = ["shared_gate", "dense_groups", "glu_gemm", "combine_gemm"]
    assert kernels(plans["layer"], "gemv") == ["router_route_group"] + shared + ["glu_gemm", "combine_gemm"]
    assert kernels(plans["monolithic"], "large") == ["router_route", "chunk_histogram", "chunk_scan", "chunk_scatter",
                                                     *shared, "glu_gemm", "combine_gemm", "cast"]
    assert kernels(plans["modular"], "decode")[0] == "map_and_group"
    assert kernels(plans["modular"], "mid")[:2] == ["map_ids", "chunk_histogram"]
    assert [i["name"] for i in plans["modular"]["extra_inputs"]] == ["topk_weights", "topk_ids"]
    assert plans["monolithic"]["layer"]["entry"] == "monolithic" and plans["layer"]["layer"]["global_experts"] == 12
    glu = next(k for k in plans["layer"]["kernels"].values() if k["kernel"] == "glu_gemm"
               and k["constexprs"]["NUM_EXPERTS"] == 8)
    assert glu["constexprs"]["SCALE_ROWS"] is True
    assert set(plans["layer"]["parameters"]) >= {"expert_map", "shared_w13", "shared_gate_weight"}

    cm.save(tmp_path / "m.mxmoe")
    assert "3 entries" in Artifact(tmp_path / "m.mxmoe").code().describe()
    mod = load(tmp_path / "m.mxmoe", device="interpret")
    x = _x(6, 64, seed=1)
    logits = _x(6, 12, seed=2)
    w = torch.rand(6, 1, generator=torch.Generator().manual_seed(3)) + 0.1
    ids = torch.tensor([[0], [3], [11], [12], [-1], [7]], dtype=torch.int32)  # 12 and -1: nowhere; some remote
    for name, args, ref in (("layer", (x,), layer(x)), ("monolithic", (x, logits), layer.monolithic(x, logits)),
                            ("modular", (x, w, ids), layer.modular(x, w, ids))):
        out = mod.entry(name)(*args)
        assert torch.equal(out, cm.entry(name)(*args)), name
        _check(out, ref)


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
def test_a_bf16_shared_expert_runs_dense(gate, deterministic):
    """A shared expert held in bf16 (shared_format="bf16"): dense_glu + dense_out beside the routed experts, added
    into the accumulator (two adds) or written as rows for the deterministic combine (top-2 + shared: three adds);
    the "shared" entry alone is the reference's bits (the same roundings, sums of 64-wide tiles in order)."""
    layer = MoE.random(_cfg(shared_intermediate=96, shared_format="bf16", shared_gate=gate, activation="silu",
                            interleaved=False), seed=4)
    cm = mxmoe.compile(layer, target="cuda:sm_90", interpret=True, entries=["layer", "modular", "shared"],
                       deterministic=deterministic)
    plans = cm.code.plans
    kinds = {k["kernel"] for k in plans["layer"]["kernels"].values()}
    assert {"dense_glu", "dense_out"} <= kinds and "dense_groups" not in kinds
    assert plans["layer"]["parameters"]["shared_w13"]["role"] == "dense"
    for T in (1, 9, 40):
        x = _x(T, 64, seed=T)
        _check(cm(x), layer(x))
        assert torch.equal(cm.entry("shared")(x), layer._shared_expert(x))
        w = torch.rand(T, 2, generator=torch.Generator().manual_seed(T)) + 0.1
        ids = torch.full((T, 2), 8, dtype=torch.int32)  # the sentinel: the shared expert alone
        ids[::3, 0] = 2
        _check(cm.entry("modular")(x, w, ids), layer.modular(x, w, ids))


def test_the_shared_entry_in_its_row_classes():
    """The "shared" entry alone (an MXFP4 shared expert, one expert of T rows): on sm_90 its classes follow T rows per
    expert, so 100 / 140 / 200 tokens run mid_wide, prefill and the large tiles (from 160 rows); each against the
    layer's own shared expert, and the whole layer beside it."""
    layer = MoE.random(_cfg(shared_intermediate=96, shared_gate=True), seed=4)
    cm = mxmoe.compile(layer, target="cuda:sm_90", interpret=True, entries=["layer", "shared"])
    plan = cm.code.plans["shared"]
    assert [(c["name"], c["max_tokens"]) for c in plan["classes"]][2:] == [
        ("mid", 96), ("mid_wide", 128), ("prefill", 159), ("large", None)]
    for T in (100, 140, 200):
        x = _x(T, 64, seed=T)
        _check(cm.entry("shared")(x), layer._shared_expert(x))
        _check(cm(x), layer(x))


# -------------------------------------------- the families' routers and activations (issue #24, item 3)

FAMILY_CASES = {
    # DeepSeek-V3's router: fp32 logits, sigmoid scores + correction bias, 4 groups of 4 keep 2, renormalised, x2.5
    "sigmoid_topk-groups-fp32": dict(E=16, k=3, routing="sigmoid_topk", n_group=4, topk_group=2, score_bias=True,
                                     renormalize=True, routed_scaling_factor=2.5, router_fp32=True,
                                     router_bias=False, activation="silu", interleaved=False),
    # Llama-4: top-1 by logit, its sigmoid scaling the input; gelu
    "topk_sigmoid-on-input-gelu": dict(k=1, routing="topk_sigmoid", apply_router_weight_on_input=True,
                                       activation="gelu", interleaved=False),
    "sigmoid_topk-gelu_tanh": dict(E=12, k=3, routing="sigmoid_topk", activation="gelu_tanh", interleaved=False,
                                   bias=False),
    "softmax_topk-silu_clamped-scaled": dict(k=2, routing="softmax_topk", renormalize=True, activation="silu_clamped",
                                             swiglu_limit=1.0, routed_scaling_factor=0.5),
}


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def family_module(request):
    layer = MoE.random(_cfg(**FAMILY_CASES[request.param]), seed=3)
    return layer, mxmoe.compile(layer, target="cuda:sm_90", interpret=True, entries="all")


@pytest.mark.parametrize("T", [1, 5, 40])
def test_family_routers_and_activations_in_every_entry(family_module, T):
    """The layer entry (its router), the monolithic entry (the engine's logits: fp32 for an fp32 router) and the
    modular entry (with ids outside the layer) of layers with the families' routers and GLUs, against the
    reference; the layer's routing weights are the reference's too (scaling and renormalisation included)."""
    layer, cm = family_module
    cfg = layer.config
    x = _x(T, cfg.hidden, seed=T)
    _check(cm(x), layer(x))
    gen = torch.Generator().manual_seed(100 + T)
    logits = torch.randn(T, cfg.experts_routed, generator=gen).to(torch.float32 if cfg.router_fp32 else x.dtype)
    _check(cm.entry("monolithic")(x, logits), layer.monolithic(x, logits))
    w = torch.rand(T, cfg.top_k, generator=gen) + 0.1
    ids = torch.randint(-1, cfg.experts_routed + 1, (T, cfg.top_k), generator=gen, dtype=torch.int32)
    ids[0] = torch.arange(cfg.top_k)  # at least one routed pair
    _check(cm.entry("modular")(x, w, ids), layer.modular(x, w, ids))


def test_family_plans_carry_the_routing_constants(family_module):
    layer, cm = family_module
    cfg = layer.config
    plan = cm.code.plans["layer"]
    routers = [k for k in plan["kernels"].values() if k["kernel"] in ("router_route_group", "router_route",
                                                                       "route_partials")]
    assert routers
    for k in routers:
        c = k["constexprs"]
        assert c.get("SIGMOID", 0) == {"sigmoid_topk": 2, "topk_sigmoid": 1}.get(cfg.routing, 0)
        assert c.get("SCALING", 1.0) == cfg.routed_scaling_factor
        assert c.get("N_GROUP", 1) == (cfg.n_group if cfg.topk_group < cfg.n_group else 1)
        assert c.get("HAS_SCORE_BIAS", False) == cfg.score_bias
        assert c["ROUND_LOGITS_BF16"] == (not cfg.router_fp32)
    assert plan["layer"]["router_fp32"] == cfg.router_fp32
    mono = cm.code.plans["monolithic"]
    assert mono["extra_inputs"][0]["dtype"] == ("float32" if cfg.router_fp32 else "bfloat16")
    glu = [k for k in plan["kernels"].values() if k["kernel"] == "glu_gemm"]
    assert {k["constexprs"].get("ACTIVATION", 0) for k in glu} == {
        {"gelu": 1, "gelu_tanh": 2, "silu_clamped": 3}.get(cfg.activation, 0)}


@pytest.mark.parametrize("shared_format", ["mxfp4", "bf16"])
def test_family_kernels_build_cubins_for_sm90(shared_format):
    """The AOT path (``triton.compile`` for GPUTarget("cuda", 90, 32)) builds every kernel of every entry's plan
    with the new constants: an fp32 sigmoid router with groups and a correction bias, gelu_tanh, a gated shared
    expert of either format (the bf16 one: dense_glu / dense_out), an expert map."""
    cfg = _cfg(**{**FAMILY_CASES["sigmoid_topk-groups-fp32"], "activation": "gelu_tanh"}, shared_intermediate=64,
               shared_gate=True, global_num_experts=20, shared_format=shared_format)
    cm = mxmoe.compile(MoE.random(cfg, seed=0), target="cuda:sm_90", entries="all")
    for entry, plan in cm.code.plans.items():
        binaries = cm.code.binaries if entry == cm.code.entry_name else cm.code.more[entry][1]
        assert set(binaries) == set(plan["kernels"]) == set(plan["cubins"]), entry
        assert all(blob[:4] == b"\x7fELF" for blob in binaries.values()), entry
    kinds = {k["kernel"] for plan in cm.code.plans.values() for k in plan["kernels"].values()}
    assert {"shared_gate", "map_ids", "map_and_group"} <= kinds
    assert ({"dense_glu", "dense_out"} if shared_format == "bf16" else {"dense_groups"}) <= kinds


@pytest.mark.parametrize("T", [100, 1100])
def test_monolithic_with_an_expert_map_in_the_many_token_routers(T):
    """The engine's logits through the split router (100 tokens: route_partials) and router_route (1100), routed
    over 12 global experts and mapped to the 8 local ones (another rank's pairs grouped nowhere), with a sigmoid
    router: the plans' launches and the output against the reference."""
    layer = MoE.random(_cfg(global_num_experts=12, routing="sigmoid_topk", renormalize=True,
                            routed_scaling_factor=1.5, activation="silu", interleaved=False), seed=6)
    cm = mxmoe.compile(layer, target="cuda:sm_90", interpret=True, entries=["monolithic"])
    plan = cm.kernel_plan
    cls = next(c for c in plan["classes"] if c["max_tokens"] is None or T <= c["max_tokens"])
    kinds = [plan["kernels"][lc["kernel"]]["kernel"] for lc in cls["launches"]]
    assert kinds[0] == ("route_partials" if T == 100 else "router_route") and "router_gemm" not in kinds
    assert plan["kernels"][cls["launches"][0]["kernel"]]["constexprs"]["HAS_MAP"] is True
    x = _x(T, 64, seed=T)
    logits = _x(T, 12, seed=T + 1)
    _check(cm(x, logits), layer.monolithic(x, logits))


def test_an_mxfp4_shared_expert_keeps_the_large_class():
    """An MXFP4 shared expert runs the large class's 256-row tiles like a bf16 one (until 2026-11-28 it ended with an
    unbounded prefill class: its w2 GEMM gave wrong rows when Triton 3.6 compiled it, see compile_stages)."""
    def classes(**kw):
        cfg = _cfg(E=16, k=3, H=384, I=320, shared_intermediate=256, **kw)
        return [(c["name"], c["max_tokens"]) for c in
                mxmoe.compile(MoE.random(cfg, seed=0), target="cuda:sm_90", interpret=True).kernel_plan["classes"]]

    assert classes(shared_gate=True)[-1] == ("large", None)
    assert classes(shared_format="bf16")[-1] == ("large", None)
