"""The w4a8 form (``activations="mxfp8"``) on a CUDA GPU: the Hopper fp8 path (or sm_100's block-scaled MMA)
against ``numpy_reference(activations="mxfp8")`` at every token-count class. Prints nothing timed.

The module is ``mxmoe.compile(layer, target=..., activations="mxfp8")``; where the GPU machine has no compiler,
bundles from ``python benchmarks/gpu_moe.py --build DIR --activations mxfp8 --models 'gpt-oss-20b;8,3,512,352'``
(named ``MODEL+mxfp8``) in ``MXMOE_GPU_PLANS``."""

import os

import ml_dtypes
import pytest
import torch

from mxmoe.core.config import MoEConfig
from mxmoe.core.reference import numpy_reference, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: end to end against the mxfp8 reference: the GLU output is quantized to e4m3 between the GEMMs, and a GLU value that
#: sums or rounds a hair differently from the reference's lands on the other side of an e4m3 step (1/16-1/8 of it)
#: now and then; the second GEMM multiplies those steps into every output (H200, 2026-11-27: up to 4.4e-2 on layers
#: whose weight scales spread over 15 binades, 1.0-1.6e-2 on gpt-oss-20b). Each GEMM on its own (sm_90, where the GLU
#: output is a buffer): the first against the reference's GLU output, the second against the reference run from the
#: module's own GLU output: the fp8 MMAs' sums, no quantization flips. Against the bf16 reference a sanity bound only:
#: what MXFP8 activations cost grows with the outliers and the token count (docs/nvidia.md).
TOL_MXFP8, TOL_GEMM, TOL_BF16 = 6e-2, 2e-2, 0.25


def _module(model: str, layer):
    """A callable on CUDA tensors running ``layer`` in the w4a8 form of this GPU's arch."""
    from mxmoe.runtime.triton_executor import TritonExecutor

    plans = os.environ.get("MXMOE_GPU_PLANS")
    if plans:
        from mxmoe.kernels.triton.kernel_plan import plan_parameters, read_bundle

        base = "shape-" + model.replace(",", "-") if "," in model else model
        plan, binaries = read_bundle(os.path.join(plans, base + "+mxfp8"))
        assert plan["options"]["activations"] == "mxfp8"
        layer = layer.cuda()
        params = plan_parameters(plan, {s["operand"]: getattr(layer, s["operand"]) for s in plan["parameters"].values()})
        return TritonExecutor(plan, params, binaries)
    pytest.importorskip("iree.compiler", reason="no compiler here and MXMOE_GPU_PLANS not set")
    import mxmoe

    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        pytest.skip(f"no w4a8 form for compute capability {major}.x")
    return mxmoe.compile(layer, target=f"cuda:sm_{major}0", activations="mxfp8").executor()


def _x(T, H, seed):
    """N(0, 1) with three values per row at 20-200x (real hidden states' massive dimensions)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    cols = torch.randint(0, H, (T, 3), generator=g)
    x.scatter_(1, cols, torch.randn(T, 3, generator=g).sign() * torch.empty(T, 3).uniform_(20, 200, generator=g))
    return x.bfloat16()


@pytest.mark.parametrize("model", ["gpt-oss-20b", "8,3,512,352", "8,3,512,352/wide"])
def test_w4a8_matches_the_mxfp8_reference(model, widen_scales):
    """``/wide``: each weight row's scale bytes spread over 15 binades (the sm_90 decode's table at every shift, and
    its zeros for groups more than 11 binades under the row's largest scale). On sm_90 the mxfp8 reference folds as
    that form does (``mx_fold="row"``)."""
    from mxmoe.core.config import preset
    from mxmoe.torch_frontend import MoE

    model, wide = model.removesuffix("/wide"), model.endswith("/wide")
    if "," in model:
        E, k, H, I = map(int, model.split(","))
        cfg = MoEConfig(num_experts=E, top_k=k, hidden=H, intermediate=I)
    else:
        cfg = preset(model)
    layer = MoE.random(cfg, seed=0)
    if wide:
        widen_scales(layer)
    w = layer.to_weights()
    sm90 = torch.cuda.get_device_capability()[0] == 9
    fold = "row" if sm90 else "block"
    run = _module(model, layer)
    for T in (1, 8, 64, 512, 2048, 4096):
        x = _x(T, cfg.hidden, seed=T)
        bufs = run.run(x.cuda())
        out = bufs[run.kernel_plan.output].float().cpu().numpy()
        xs = x.float().numpy()
        ref, ref_glu = numpy_reference(w, xs, ml_dtypes.bfloat16, activations="mxfp8", mx_fold=fold, return_glu=True)
        e8 = relative_error(out, ref)
        e16 = relative_error(out, numpy_reference(w, xs, ml_dtypes.bfloat16))
        line = f"{model} T={T}: vs mxfp8 reference {e8:.2e}, vs bf16 reference {e16:.2e}"
        if sm90:  # the GLU output in sorted row order -> [T, k, I]
            glu = torch.zeros(T * cfg.top_k, cfg.intermediate)
            glu[bufs["sorted_pairs"][:T * cfg.top_k].long().cpu()] = bufs["glu_output"][:T * cfg.top_k].float().cpu()
            glu = glu.numpy().reshape(ref_glu.shape)
            e_glu = relative_error(glu, ref_glu)
            e_w2 = relative_error(out, numpy_reference(w, xs, ml_dtypes.bfloat16, activations="mxfp8", mx_fold=fold,
                                                       glu_output=glu))
            line += f"; w13 GEMM + GLU {e_glu:.2e}, w2 GEMM {e_w2:.2e}"
            assert e_glu <= TOL_GEMM and e_w2 <= TOL_GEMM, (T, e_glu, e_w2)
        print(line)
        assert e8 <= TOL_MXFP8 and e16 <= TOL_BF16, (T, e8, e16)
