"""The routing contract (docs/routing.md) on the reference, the cpu target and the cuda target (its Triton kernels
under the interpreter here; on a GPU in tests/kernels/test_triton_gpu.py): exact ties go to the lower expert
index, logits one ulp apart are told apart, a token's routing does not depend on the batch it runs in, and the
same input gives the same bits twice.

Router rows are built so that each token's logits are exact (a one-hot token of a power of two times bf16 router
weights, no router bias): the k-th and (k+1)-th logits of a token are then exactly equal, or exactly one bf16 ulp
apart, whatever order an implementation sums in. Experts are made far apart in what they compute, so a wrong pick
is an error of the output's own size, not a rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mxmoe
from mxmoe.core.config import MoEConfig
from mxmoe.core.weights import MoEWeights
from mxmoe.torch_frontend import MoE

H = 64


def _tied_layer(num_experts: int, top_k: int, tokens: int, gap_ulps: int, routing: str, seed: int,
                sub_ulp_bias: bool = False):
    """(layer, x, expected ids): token t is one-hot at h = t (value 2^(t % 3)); router column t gives experts
    ``a < b`` the k-th largest logit, equal (``gap_ulps=0``) or ``b``'s one bf16 ulp above (``gap_ulps=1``).
    ``sub_ulp_bias``: a router bias of e * 2^-12 for expert e (under half a bf16 ulp of the tied logits, which
    are >= 1): the fp32 sums of a tie then differ, ``b``'s larger, and only the contract's rounding ties them."""
    if tokens > H:
        raise ValueError("one router column per token: at most H tokens")
    rng = np.random.default_rng(seed)
    cfg = MoEConfig(num_experts=num_experts, top_k=top_k, hidden=H, intermediate=64, routing=routing,
                    router_bias=sub_ulp_bias, activation="silu", interleaved=False)
    w = MoEWeights.random(cfg, seed=seed)
    if sub_ulp_bias:
        w.router_bias = np.arange(num_experts, dtype=np.float32) * 2.0 ** -12
    router = np.zeros((num_experts, H), np.float32)
    x = torch.zeros(tokens, H)
    expected = []
    for t in range(tokens):
        order = rng.permutation(num_experts)
        a, b = sorted(order[top_k - 1: top_k + 1])      # the pair competing for the k-th place
        top = [int(e) for e in order[: top_k + 1] if e not in (a, b)]
        col = -4.0 - rng.integers(0, 8, num_experts).astype(np.float32)  # the rest: low (bf16 values)
        col[top] = 8.0 - np.arange(len(top), dtype=np.float32)         # clear winners
        col[a] = 1.2265625                                 # a bf16 value (the issue's tie)
        col[b] = 1.2265625 + gap_ulps * 2.0 ** -7          # one bf16 ulp above (values in [1, 2))
        router[:, t] = col
        x[t, t] = 2.0 ** (t % 3)                           # exact products: logits are 2^(t%3) * col
        expected.append(sorted(top + [int(b if gap_ulps else a)]))
    w.router_weight = router
    return MoE(w), x.bfloat16(), expected


@pytest.mark.parametrize("routing", ["topk_softmax", "softmax_topk"])
@pytest.mark.parametrize("gap_ulps", [0, 1])
def test_reference_ties_to_the_lower_index_and_sees_one_ulp(routing, gap_ulps):
    layer, x, expected = _tied_layer(16, 3, 40, gap_ulps, routing, seed=1)
    _, weights = layer.forward_with_routing(x)
    logits = torch.nn.functional.linear(x, layer.router_weight)
    from mxmoe.torch_frontend import ops

    _, ids = ops.route(logits, 3, routing, False)
    for t, want in enumerate(expected):
        assert sorted(ids[t].tolist()) == sorted(want), (t, ids[t].tolist(), want)


@pytest.fixture(scope="module")
def compiled_tied():
    out = {}
    for gap in (0, 1):
        layer, x, expected = _tied_layer(16, 3, 64, gap, "topk_softmax", seed=2)
        out[gap] = (layer, x, expected, mxmoe.compile(layer, target="cpu"))
    return out


@pytest.mark.parametrize("gap_ulps", [0, 1])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_cpu_target_follows_the_contract_at_every_token_count(compiled_tied, gap_ulps, tokens):
    """Forced ties and one-ulp gaps at token counts of every kernel form; a wrong pick would be an O(1) error."""
    layer, x, _, cm = compiled_tied[gap_ulps]
    xs = x[:tokens]
    ref = layer(xs).float()
    out = cm(xs).float()
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, f"{tokens} tokens, gap {gap_ulps}: {err}"


def _compile_on(layer: MoE, target: str, rocm_form_on_cpu):
    """``layer`` compiled for "cpu", "rocm:gfx942-on-cpu" (its lowering for this CPU) or "cuda-interpreted"."""
    if target == "cuda-interpreted":
        return mxmoe.compile(layer, target="cuda:sm_90", interpret=True)
    return mxmoe.compile(layer, target="cpu" if target == "cpu" else rocm_form_on_cpu("gfx942"))


def _tokens_off(out: torch.Tensor, ref: torch.Tensor) -> list[int]:
    """Tokens whose output is more than 2e-2 (relative to the largest reference value) off: a wrong expert."""
    err = (out.float() - ref.float()).abs().max(dim=-1).values / ref.float().abs().max()
    return torch.nonzero(err >= 2e-2).flatten().tolist()


@pytest.mark.parametrize("target", ["cpu", "rocm:gfx942-on-cpu", "cuda-interpreted"])
def test_the_router_rounds_once(target, rocm_form_on_cpu):
    """round_A(x w + b), not round_A(round_A(x w) + b). A random-config sweep found this layer's token 10 routed to
    another expert on the IREE targets: torch exports a bf16 router as a bf16 linear, which IREE lowered there as
    a rounded matmul plus a rounded bias add (compiler/passes/lowering/router_once.py since 2026-11-28). The two
    roundings tie the token's two best logits (then the lower index wins); rounding once does not."""
    from mxmoe.torch_frontend.compile import example_inputs

    cfg = MoEConfig(num_experts=12, top_k=1, hidden=96, intermediate=32, routing="topk_softmax", activation="silu",
                    interleaved=True, bias=True)
    layer = MoE.random(cfg, seed=429)
    (x,) = example_inputs(layer, "layer", 33)
    xw = x.float() @ layer.router_weight.float().T
    twice = (xw.bfloat16().float() + layer.router_bias.float()).bfloat16()
    once = torch.nn.functional.linear(x, layer.router_weight, layer.router_bias)
    assert twice[10].argmax() != once[10].argmax()  # the case stays one where the two differ
    ref = layer(x)
    assert _tokens_off(_compile_on(layer, target, rocm_form_on_cpu)(x), ref) == []
    if target == "cpu":  # the same through a program exported for these 33 tokens (static shapes)
        with torch.no_grad():
            program = torch.export.export(layer, (x,))
        assert _tokens_off(mxmoe.compile(program, target="cpu")(x), ref) == []


@pytest.mark.parametrize("routing", ["topk_softmax", "sigmoid_topk"])
@pytest.mark.parametrize("target", ["cpu", "rocm:gfx942-on-cpu", "cuda-interpreted"])
def test_ties_are_of_rounded_logits(target, routing, rocm_form_on_cpu):
    """Logits whose fp32 sums differ by less than half a bf16 ulp round to one value and tie: the lower expert wins.
    The cpu and rocm lowerings chose on the unrounded sums until 2026-11-28 where the route's first step is
    elementwise (sigmoid_topk: IREE fused it into the router's matmul and folded the logits' rounding away), so the
    higher expert won such ties there."""
    layer, x, _ = _tied_layer(16, 3, 64, 0, routing, seed=3, sub_ulp_bias=True)
    cm = _compile_on(layer, target, rocm_form_on_cpu)
    for tokens in (1, 64):
        assert _tokens_off(cm(x[:tokens]), layer(x[:tokens])) == [], f"{tokens} tokens"


def test_cpu_routing_is_batch_invariant_and_deterministic(compiled_tied):
    """A token's output in a batch of 64 is the one it gets alone (the expert choice, and here the bits), and the
    same input gives the same bits twice."""
    layer, x, _, cm = compiled_tied[0]
    batch = cm(x)
    assert torch.equal(batch, cm(x))
    for t in (0, 7, 33, 63):
        assert torch.equal(cm(x[t: t + 1])[0], batch[t]), t


def test_random_routers_route_like_the_reference_except_within_a_rounding(near_tie_tokens):
    """Random data: tokens whose k-th and (k+1)-th logits are more than the contract's rounding apart get the
    reference's experts (checked through the output); near ties may legitimately pick the other one."""
    layer = MoE.random(MoEConfig(num_experts=32, top_k=4, hidden=H, intermediate=64), seed=5)
    cm = mxmoe.compile(layer, target="cpu")
    x = torch.randn(300, H, generator=torch.Generator().manual_seed(6)).bfloat16()
    logits = torch.nn.functional.linear(x, layer.router_weight, layer.router_bias)
    free = ~near_tie_tokens(logits, 4)
    ref, out = layer(x).float(), cm(x).float()
    err = (out - ref).abs().max(dim=-1).values / ref.abs().max()
    assert (err[free] < 2e-2).all(), err[free].max()


# ------------------------------------------------------------------ the cuda target (Triton, interpreted here)

@pytest.fixture(scope="module")
def compiled_tied_cuda():
    pytest.importorskip("iree.compiler")
    out = {}
    for gap in (0, 1):
        layer, x, expected = _tied_layer(16, 3, 64, gap, "topk_softmax", seed=2)
        out[gap] = (layer, x, expected, {opt: mxmoe.compile(layer, target="cuda:sm_90", interpret=True,
                                                            **({opt: True} if opt else {}))
                                         for opt in ("", "batch_invariant")})
    return out


@pytest.mark.parametrize("gap_ulps", [0, 1])
def test_cuda_target_follows_the_contract_in_every_class(compiled_tied_cuda, gap_ulps):
    """The tied tokens at 1, 5 and 64 tokens (gemv, decode) and repeated to 300 and (batch-invariant module) 1100
    (mid, prefill for 16 experts, top 3; tests/kernels/test_triton.py routes in every class): every token gets the contract's experts (a wrong pick is an O(1) error), the same bits in
    every batch (its routing always; its output in the batch-invariant module)."""
    layer, x, _, modules = compiled_tied_cuda[gap_ulps]
    for opt, cm in modules.items():
        alone = cm(x)
        ref = layer(x).float()
        assert ((alone.float() - ref).abs().max() / ref.abs().max()) < 2e-2, opt
        for T in (1, 5, 300) + ((1100,) if opt else ()):
            rows = torch.arange(T) % 64
            out = cm(x[rows])
            err = (out.float() - ref[rows]).abs().max() / ref.abs().max()
            assert err < 2e-2, f"{opt or 'default'} module, {T} tokens, gap {gap_ulps}: {err}"
            if opt == "batch_invariant":
                assert torch.equal(out, alone[rows]), T
        assert torch.equal(cm(x), alone)


def test_cuda_options_are_recorded(tmp_path):
    """deterministic / batch_invariant reach the plan and the artifact's target record; the cpu target accepts
    them and records what it always is (deterministic; batch invariant with its C microkernel)."""
    pytest.importorskip("iree.compiler")
    layer, _, _ = _tied_layer(16, 3, 4, 0, "topk_softmax", seed=3)
    cm = mxmoe.compile(layer, target="cuda:sm_90", interpret=True, deterministic=True)
    assert cm.kernel_plan["options"] == {"deterministic": True, "batch_invariant": False}
    assert cm.target.record(cm.code, cm.mlir)["numerics"] == {"deterministic": True, "batch_invariant": False}
    cm.save(tmp_path / "a.mxmoe")
    from mxmoe.runtime.artifact import Artifact

    assert Artifact(tmp_path / "a.mxmoe").manifest["target"]["numerics"]["deterministic"] is True
    cpu = mxmoe.compile(layer, target="cpu", batch_invariant=True)
    assert cpu.target.record(cpu.code, cpu.mlir)["numerics"]["deterministic"] is True
    # deterministic is the cuda default (it cost under 1% on the H100); deterministic=False is the atomics path
    assert mxmoe.compile(layer, target="cuda:sm_90", interpret=True).kernel_plan["options"]["deterministic"] is True
    fast = mxmoe.compile(layer, target="cuda:sm_90", interpret=True, deterministic=False)
    assert fast.kernel_plan["options"] == {"deterministic": False, "batch_invariant": False}
    with pytest.raises(ValueError, match="batch_invariant=True implies deterministic"):
        mxmoe.compile(layer, target="cuda:sm_90", interpret=True, deterministic=False, batch_invariant=True)
    with pytest.raises(ValueError, match="rocm:gfx942 does not offer deterministic"):
        mxmoe.compile(layer, target="rocm:gfx942", deterministic=True)


# ------------------------------------------------------------------ the cuda target on a GPU (the issue's case)

def _issue_layer_and_tokens():
    """The layer and batch of the routing issue: E=64, top-6, H=2048, I=1408, 4096 tokens; token 3467's k-th
    and (k+1)-th logits were an exact bf16 tie that the large shape classes broke the other way."""
    layer = MoE.random(MoEConfig(num_experts=64, top_k=6, hidden=2048, intermediate=1408), seed=0)
    x = torch.randn(4096, 2048, generator=torch.Generator().manual_seed(4096)).bfloat16()
    return layer, x


_ISSUE_OPTIONS = ("", "deterministic", "batch_invariant")
#: the modules tests/write_gpu_modules.py builds for a GPU machine without the compiler
GPU_MODULES = {f"routing-issue-{opt or 'default'}": (lambda: _issue_layer_and_tokens()[0], "cuda:sm_90",
                                                     {opt: True} if opt else {}) for opt in _ISSUE_OPTIONS}


@pytest.fixture(scope="module")
def issue_modules(gpu_module):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    layer, x = _issue_layer_and_tokens()
    modules = {opt: gpu_module(f"routing-issue-{opt or 'default'}", layer, "cuda:sm_90", **({opt: True} if opt else {}))
               for opt in _ISSUE_OPTIONS}
    return layer, x, modules


@pytest.mark.gpu
@pytest.mark.parametrize("opt", ["", "deterministic", "batch_invariant"])
def test_gpu_a_tokens_experts_do_not_depend_on_its_batch(issue_modules, opt, near_tie_tokens):
    """Every row of the 4096-token batch routes as the same token alone and in a batch of 64 (a different expert is
    an O(1) error); the batch-invariant module gives the same bits; rows around 3467 (the issue's tie) route like
    the reference except within the contract's rounding allowance (near ties of the fp32 sums)."""
    layer, x, modules = issue_modules
    cm = modules[opt]
    xg = x.cuda()
    big = cm(xg).float().cpu()
    window = slice(3440, 3480)
    ref = layer(x[window]).float()
    logits = torch.nn.functional.linear(x[window], layer.router_weight, layer.router_bias)
    err = (big[window] - ref).abs().max(dim=-1).values / ref.abs().max()
    free = ~near_tie_tokens(logits, layer.config.top_k)
    assert (err[free] < 2e-2).all(), f"rows {(torch.nonzero(free & (err >= 2e-2)).flatten() + 3440).tolist()}"
    for rows in (torch.arange(3400, 3464), torch.tensor([3467]), torch.arange(0, 4096, 61)):
        small = cm(xg[rows.cuda()]).float().cpu()
        err = ((small - big[rows]).abs().max(dim=-1).values / big.abs().max()).max().item()
        assert err < 2e-2, f"{opt or 'default'}: rows {rows[:3].tolist()}... route differently alone ({err:.3g})"
        if opt == "batch_invariant":
            assert torch.equal(small, big[rows]), f"rows {rows[:3].tolist()}...: not the same bits alone"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [7, 512, 4096, 16384])
def test_gpu_deterministic_module_gives_the_same_bits_twice(issue_modules, T):
    layer, x, modules = issue_modules
    xs = x.repeat((T + 4095) // 4096, 1)[:T].cuda()
    for opt in ("deterministic", "batch_invariant"):
        a, b = modules[opt](xs), modules[opt](xs)
        assert torch.equal(a, b), f"{opt}, T={T}: two runs differ by {(a.float() - b.float()).abs().max().item()}"
