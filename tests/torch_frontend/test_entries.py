"""The fused-MoE interface through the compiler: the layer, monolithic and modular entries of one compiled module,
expert parallelism (global ids, an expert map, -1 for another rank's experts), router weight on input, shared
experts (MXFP4 or bf16, with and without a gate), against the plain-torch reference (``MoE``) and its numpy twin.

Compiled on the cpu target (its blocksplit layout and C microkernel), for this CPU with exactly the linalg each
ROCm target emits (the row-block lowering of the row-major layout: gfx950's ``scaling_extf`` decode, gfx942's integer
one), and on the cuda:sm_90 target with its Triton kernels under the interpreter, so every lowering meets every
feature.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import mxmoe
from mxmoe.core.config import MoEConfig
from mxmoe.core.reference import numpy_reference, relative_error
from mxmoe.torch_frontend import MoE

#: name -> a target, or the arch of a ROCm target whose lowering is compiled for this CPU (``rocm_form_on_cpu``)
TARGETS = {"cpu": "cpu", "rocm:gfx950-on-cpu": "gfx950", "rocm:gfx942-on-cpu": "gfx942",
           "cuda-interpreted": "cuda:sm_90"}
BF16 = ml_dtypes.bfloat16
#: bf16 outputs: the compiled sums may round once differently from torch's (a bf16 ulp), and a shared expert's bf16
#: linear layers are summed in another order by IREE than by torch
TOL = 2e-2


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=8, top_k=2, hidden=64, intermediate=96, activation="silu", interleaved=False)
    base.update(kw)
    return MoEConfig(**base)


def _x(t: int, h: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _routing(cfg: MoEConfig, t: int, seed: int, ids_range=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing: k distinct global ids per token (or any ids in ``ids_range``), weights in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(t, cfg.top_k, generator=g) + 0.05
    if ids_range is None:
        ids = torch.stack([torch.randperm(cfg.experts_routed, generator=g)[:cfg.top_k] for _ in range(t)])
    else:
        ids = torch.randint(ids_range[0], ids_range[1], (t, cfg.top_k), generator=g)
    return w, ids.to(torch.int32)


def _check(out, ref, what: str):
    err = relative_error(np.asarray(out.float().numpy()), np.asarray(ref.float().numpy() if torch.is_tensor(ref) else ref))
    assert err <= TOL, f"{what}: relative error {err:.3g}"


FEATURES = {
    "plain": {},
    "expert-parallel": dict(global_num_experts=20),
    "weight-on-input": dict(top_k=1, apply_router_weight_on_input=True),
    "shared-mxfp4": dict(shared_intermediate=64),
    "shared-mxfp4-gate": dict(shared_intermediate=64, shared_gate=True, routing="softmax_topk", renormalize=True),
    "shared-bf16-gate": dict(shared_intermediate=96, shared_gate=True, shared_format="bf16"),
    "everything": dict(top_k=1, global_num_experts=12, apply_router_weight_on_input=True, shared_intermediate=64,
                       shared_gate=True, activation="swiglu_oai", interleaved=True),
}


#: the ROCm lowerings on the CPU check these features in the default suite (the rest with -m slow): each compile
#: takes ~4 s, and the cpu and interpreted cuda targets run every feature
_ROCM_QUICK = {"everything", "shared-mxfp4-gate", "expert-parallel", "shared-bf16-gate"}


@pytest.fixture(scope="module", params=[
    pytest.param((f, t), id=f"{f}-{t}",
                 marks=() if not t.startswith("rocm") or f in _ROCM_QUICK else pytest.mark.slow)
    for t in TARGETS for f in FEATURES])
def compiled(request, rocm_form_on_cpu):
    feature, name = request.param
    target = TARGETS[name]
    if target not in ("cpu", "cuda:sm_90"):
        target = rocm_form_on_cpu(target)
    layer = MoE.random(_cfg(**FEATURES[feature]), seed=3)
    if target == "cuda:sm_90":  # the Triton kernels under the interpreter
        return layer, mxmoe.compile(layer, target=target, entries="all", interpret=True)
    return layer, mxmoe.compile(layer, target=target, entries="all")


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_every_entry_matches_the_reference(compiled, tokens):
    layer, cm = compiled
    cfg = layer.config
    x = _x(tokens, seed=tokens)
    _check(cm(x), layer(x), "layer")
    logits = _x(tokens, cfg.experts_routed, seed=100 + tokens)
    _check(cm.entry("monolithic")(x, logits), layer.monolithic(x, logits), "monolithic")
    w, ids = _routing(cfg, tokens, seed=tokens)
    _check(cm.entry("modular")(x, w, ids), layer.modular(x, w, ids), "modular")


def test_the_torch_reference_is_the_numpy_reference(compiled):
    """Both references agree bit for bit on every entry (the numpy one is what a torch-free deploy box checks)."""
    layer, _ = compiled
    cfg, w8 = layer.config, layer.to_weights()
    x = _x(9, seed=5)
    xs = x.float().numpy()
    assert np.array_equal(layer(x).float().numpy(), numpy_reference(w8, xs, BF16))
    logits = _x(9, cfg.experts_routed, seed=6)
    assert np.array_equal(layer.monolithic(x, logits).float().numpy(),
                          numpy_reference(w8, xs, BF16, entry="monolithic", router_logits=logits.float().numpy()))
    w, ids = _routing(cfg, 9, seed=7, ids_range=(-2, cfg.experts_routed + 2))
    assert np.array_equal(layer.modular(x, w, ids).float().numpy(),
                          numpy_reference(w8, xs, BF16, entry="modular", topk_weights=w.numpy(), topk_ids=ids.numpy()))


def test_ids_outside_the_layer_contribute_nothing(compiled):
    """Ids of another rank's experts, ids past the global count (an engine's skip sentinel) and negative ids add
    nothing: a token whose every id is such gets the shared expert alone (or zeros)."""
    layer, cm = compiled
    cfg = layer.config
    t = 6
    x = _x(t, seed=8)
    w, _ = _routing(cfg, t, seed=9)
    nowhere = torch.full((t, cfg.top_k), cfg.experts_routed, dtype=torch.int32)  # the sentinel
    nowhere[::2] = -1
    if cfg.expert_parallel:
        remote = np.flatnonzero(layer.expert_map.numpy() < 0)[:1]
        nowhere[1] = int(remote[0])
    out = cm.entry("modular")(x, w, nowhere)
    if cfg.shared_intermediate:
        _check(out, layer._shared_expert(x), "shared expert alone")
    else:
        assert not out.float().abs().any()
    _check(out, layer.modular(x, w, nowhere), "modular, nothing routed here")


def test_experts_with_no_tokens_and_all_tokens_on_one_expert(compiled):
    layer, cm = compiled
    cfg = layer.config
    x = _x(40, seed=10)
    local = np.flatnonzero(layer.expert_map.numpy() >= 0) if cfg.expert_parallel else np.arange(cfg.num_experts)
    ids = torch.tensor(local[:cfg.top_k], dtype=torch.int32).repeat(40, 1)  # every token on the same experts
    w, _ = _routing(cfg, 40, seed=11)
    _check(cm.entry("modular")(x, w, ids), layer.modular(x, w, ids), "all tokens on the same experts")


def test_int64_ids_and_batched_hidden_states_in_the_reference():
    """The reference takes int64 ids (engines pass either) and [B, S, H] hidden states."""
    layer = MoE.random(_cfg(global_num_experts=16), seed=1)
    x = _x(6, seed=2)
    w, ids = _routing(layer.config, 6, seed=3)
    assert torch.equal(layer.modular(x, w, ids), layer.modular(x, w, ids.long()))
    assert torch.equal(layer.modular(x.reshape(2, 3, 64), w, ids), layer.modular(x, w, ids).reshape(2, 3, 64))


@pytest.mark.parametrize("kw, match", [
    (dict(top_k=2, apply_router_weight_on_input=True), "apply_router_weight_on_input needs top_k 1"),
    (dict(global_num_experts=4), "global_num_experts must be an int >= num_experts"),
    (dict(shared_gate=True), "shared_gate needs a shared expert"),
    (dict(shared_intermediate=40), "shared_intermediate must be 0 or a positive multiple of 32"),
    (dict(shared_intermediate=64, shared_format="fp8"), "shared_format must be one of"),
])
def test_bad_configs_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_bad_entry_inputs_are_named():
    layer = MoE.random(_cfg(), seed=0)
    x = _x(4)
    with pytest.raises(ValueError, match=r"router_logits must be \[T, 8\] for 4 tokens"):
        layer.monolithic(x, _x(4, 9))
    with pytest.raises(ValueError, match=r"topk_weights and topk_ids must be \[T, 2\]"):
        layer.modular(x, torch.ones(4, 3), torch.zeros(4, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_ids must be int32 or int64"):
        layer.modular(x, torch.ones(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="unknown entry 'sideways'"):
        mxmoe.compile(layer, target="cpu", entries=["sideways"])
    no_router = MoE.random(_cfg(router=False, router_bias=False), seed=0)
    with pytest.raises(ValueError, match="has no router"):
        no_router(x)
    with pytest.raises(ValueError, match="entry 'layer' needs a layer with its own router"):
        mxmoe.compile(no_router, target="cpu", entries=["layer"])


def test_a_layer_without_router_compiles_its_engine_entries():
    layer = MoE.random(_cfg(router=False, router_bias=False), seed=4)
    cm = mxmoe.compile(layer, target="cpu")
    assert [e.name for e in cm.entries] == ["monolithic", "modular"]
    x = _x(5, seed=1)
    logits = _x(5, 8, seed=2)
    _check(cm(x, logits), layer.monolithic(x, logits), "default entry")


def test_entries_survive_an_artifact(tmp_path):
    """An artifact holds every entry over one weight set; the runtime calls each."""
    from mxmoe.runtime import load

    layer = MoE.random(_cfg(global_num_experts=12, shared_intermediate=64), seed=2)
    cm = mxmoe.compile(layer, target="cpu", entries="all")
    cm.save(tmp_path / "l.mxmoe")
    mod = load(tmp_path / "l.mxmoe")
    assert mod.entry_names == cm.entry_names == ["layer", "monolithic", "modular"]
    x = _x(5, seed=3)
    w, ids = _routing(layer.config, 5, seed=4)
    np.testing.assert_array_equal(np.asarray(mod.entry("modular")(x, w, ids).float()),
                                  np.asarray(cm.entry("modular")(x, w, ids).float()))
    with pytest.raises(ValueError, match="no entry point 'shared'"):
        mod.entry("shared")


@pytest.mark.parametrize("name, tokens", [
    # of the ROCm forms (8 s each) the default suite compiles gfx942's at T = 1 (the case iree-compile broke)
    pytest.param(name, tokens, marks=pytest.mark.slow if name.startswith("rocm") and (tokens > 1 or "gfx950" in name)
                 else ()) for name in TARGETS for tokens in (1, 3)])
def test_programs_exported_with_static_shapes(name, tokens, rocm_form_on_cpu):
    """``torch.export.export`` without ``dynamic_shapes`` fixes T; every lowering takes such a program (its ops are
    generalised to any T and cast back) and the module then refuses any other T in one line."""
    from mxmoe.torch_frontend.compile import entry_module, example_inputs

    layer = MoE.random(_cfg(**FEATURES["everything"]), seed=5)
    target = TARGETS[name] if TARGETS[name] in ("cpu", "cuda:sm_90") else rocm_form_on_cpu(TARGETS[name])
    kw = {"interpret": True} if target == "cuda:sm_90" else {}
    for entry in ("layer", "modular"):
        module = entry_module(layer, entry)
        inputs = example_inputs(layer, entry, tokens)
        with torch.no_grad():
            program = torch.export.export(module, inputs)
        cm = mxmoe.compile(program, target=target, **kw)
        _check(cm(*inputs), module(*inputs), f"{entry} at T={tokens}")
        other = example_inputs(layer, entry, tokens + 1)
        with pytest.raises(ValueError, match=f"dim 0 must be {tokens}"):
            cm(*other)
