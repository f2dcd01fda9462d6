"""The reference MoE layer against transformers' own gpt-oss MLP, and its variants against a direct formula."""

import pytest
import torch

from mxmoe.core.config import PRESETS, MoEConfig
from mxmoe.torch_frontend import MoE

transformers = pytest.importorskip("transformers")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _transformers_out(mlp, x):
    out = mlp(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_transformers_gpt_oss_mlp(tokens, dtype, tol):
    moe = MoE.random(PRESETS["tiny"], seed=1, dtype=dtype)
    mlp = moe.to_transformers().to(dtype)
    x = torch.randn(tokens, PRESETS["tiny"].hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.no_grad():
        ours = moe(x)
        theirs = _transformers_out(mlp, x.unsqueeze(0)).reshape(ours.shape)
    assert ours.shape == x.shape and ours.dtype == dtype
    assert _rel(ours, theirs) < tol


def test_from_transformers_round_trip_keeps_the_math():
    """A float GptOssMLP quantized on the way in computes what its dequantized weights compute."""
    moe = MoE.random(PRESETS["tiny"], seed=2, dtype=torch.float32)
    mlp = moe.to_transformers()                    # weights exactly representable in MXFP4
    again = MoE.from_transformers(mlp)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(again, name), getattr(moe, name)), name
    x = torch.randn(9, PRESETS["tiny"].hidden)
    assert _rel(again(x), moe(x)) < 1e-6


def _formula(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE written out densely: every expert for every token, masked by the routing."""
    cfg = moe.config
    w13, w2 = moe.dequantized_experts()
    xf = x.float()
    logits = xf @ moe.router_weight.float().t()
    if moe.router_bias is not None:
        logits = logits + moe.router_bias.float()
    if cfg.routing == "topk_softmax":
        vals, ids = logits.sort(dim=-1, descending=True, stable=True)
        weights = vals[:, :cfg.top_k].softmax(-1)
    else:
        vals, ids = logits.softmax(-1).sort(dim=-1, descending=True, stable=True)
        weights = vals[:, :cfg.top_k]
        if cfg.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    ids = ids[:, :cfg.top_k]
    out = torch.zeros_like(xf)
    for t in range(x.shape[0]):
        for j in range(cfg.top_k):
            e = ids[t, j]
            h = w13[e] @ xf[t] + (moe.w13_bias[e].float() if moe.w13_bias is not None else 0)
            gate, up = (h[0::2], h[1::2]) if cfg.interleaved else h.chunk(2)
            if cfg.activation == "swiglu_oai":
                gate, up = gate.clamp(max=cfg.swiglu_limit), up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
                a = (up + 1) * gate * torch.sigmoid(cfg.swiglu_alpha * gate)
            else:
                a = up * gate * torch.sigmoid(gate)
            y = w2[e] @ a + (moe.w2_bias[e].float() if moe.w2_bias is not None else 0)
            out[t] += weights[t, j] * y
    return out


VARIANTS = [
    dict(),
    dict(routing="softmax_topk", renormalize=True),
    dict(routing="softmax_topk", renormalize=False),
    dict(activation="silu", interleaved=False),
    dict(bias=False, router_bias=False),
    dict(top_k=1),
    dict(top_k=8),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "gpt-oss")
def test_variants_match_the_dense_formula(variant):
    cfg = PRESETS["tiny"].replace(**variant)
    moe = MoE.random(cfg, seed=3, dtype=torch.float32)
    x = torch.randn(6, cfg.hidden, generator=torch.Generator().manual_seed(0))
    assert _rel(moe(x), _formula(moe, x)) < 1e-5


def test_batch_sequence_input_keeps_its_shape():
    moe = MoE.random("tiny", seed=0)
    x = torch.randn(2, 3, PRESETS["tiny"].hidden, dtype=torch.bfloat16)
    y = moe(x)
    assert y.shape == x.shape
    assert torch.equal(y.reshape(6, -1), moe(x.reshape(6, -1)))


def test_ties_go_to_the_lower_expert():
    """Equal logits: the lower expert index wins, in the reference and so in every compiled path."""
    from mxmoe.torch_frontend import ops

    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    w, ids = ops.route(logits, 2, "topk_softmax", False)
    assert ids.tolist() == [[1, 2]]
    assert torch.allclose(w, torch.tensor([[0.5, 0.5]]))


@pytest.mark.parametrize("bad, match", [
    (lambda m: torch.randn(4, 65, dtype=torch.bfloat16), r"input must be \[T, 64\]"),
    (lambda m: torch.randn(4, 64, dtype=torch.float32), "does not match the layer's dtype"),
    (lambda m: torch.randn(64, dtype=torch.bfloat16), r"input must be"),
])
def test_bad_inputs_name_the_problem(bad, match):
    moe = MoE.random("tiny")
    with pytest.raises(ValueError, match=match):
        moe(bad(moe))


def test_presets_have_the_gpt_oss_shapes():
    assert (PRESETS["gpt-oss-20b"].num_experts, PRESETS["gpt-oss-20b"].top_k, PRESETS["gpt-oss-20b"].hidden,
            PRESETS["gpt-oss-20b"].intermediate) == (32, 4, 2880, 2880)
    assert (PRESETS["gpt-oss-120b"].num_experts, PRESETS["gpt-oss-120b"].top_k) == (128, 4)
    with pytest.raises(ValueError):
        MoEConfig(num_experts=4, top_k=5, hidden=64, intermediate=64)
