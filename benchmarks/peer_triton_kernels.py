"""The Hopper peer for benchmarks/gpu_moe.py: triton_kernels' ``matmul_ogs``, called as vLLM 0.33 calls it.

vLLM runs gpt-oss's MXFP4 MoE on Hopper through triton_kernels (vendored in vLLM): weights and scales swizzled
into its Hopper layouts once, then per forward the router linear (torch), ``routing`` (top-k + softmax over the
k, gather/scatter indices), ``matmul_ogs`` with the gather and the fused clamped SwiGLU, and ``matmul_ogs`` with the
scatter and the routing weights. Get it with ``bash ../shared/peers/get_triton_kernels.sh build/peers`` on a
machine with the package index, and carry ``build/peers`` to the GPU machine; nothing of it is committed here.

What it cannot run (each row of the table says so): a top-k that is not a power of two (its routing), and layers
other than gpt-oss's semantics (clamped SwiGLU on interleaved gate/up rows, biases, top-k then softmax).
"""

from __future__ import annotations

import os
import sys


class Peer:
    """triton_kernels imported from ``peer_dir`` (``peer_dir/triton_kernels``), with vLLM's sm_90 settings."""

    def __init__(self, peer_dir: str):
        sys.path.insert(0, os.path.abspath(peer_dir))
        import torch.nn.functional as F
        import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
        from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
        from triton_kernels.numerics import InFlexData
        from triton_kernels.routing import routing
        from triton_kernels.swiglu import swiglu_fn
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout

        opt_flags.update_opt_flags_constraints({"split_k": 1})  # as vLLM sets on sm_90
        self.F, self.matmul_ogs, self.routing = F, matmul_ogs, routing
        self._precision = lambda s: PrecisionConfig(weight_scale=s, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        self._fp4, self._convert, self._wrap = FP4, convert_layout, wrap_torch_tensor
        self._vl, self._vopts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        self._sl, self._sopts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        self._fused = lambda alpha, limit: FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")),
                                                           (alpha, limit), 2)

    @staticmethod
    def unsupported(config) -> str | None:
        """Why the peer cannot run a layer of ``config`` (None: it can)."""
        if config.top_k & (config.top_k - 1):
            return f"top_k {config.top_k} is not a power of two (its routing)"
        if not (config.activation == "swiglu_oai" and config.interleaved and config.bias
                and config.routing == "topk_softmax" and config.router):
            return "only gpt-oss's semantics (clamped SwiGLU, interleaved gate/up, biases, top-k then softmax)"
        return None

    def _swizzle(self, w, s):
        """vLLM's _swizzle_mxfp4 for sm_90: K scale groups padded to a multiple of 4, the quantized axis to dim 1."""
        s = self.F.pad(s, (0, -s.shape[-1] % 4))
        w = self._convert(self._wrap(w.transpose(-2, -1), dtype=self._fp4), self._vl, **self._vopts)
        s = self._convert(self._wrap(s.transpose(-2, -1)), self._sl, **self._sopts)
        return w, self._precision(s)

    def layer(self, layer) -> dict:
        """The layer's weights in the peer's layouts (a copy: the benchmark cycles through several)."""
        w1, pc1 = self._swizzle(layer.w13.clone(), layer.w13_scale.clone())
        w2, pc2 = self._swizzle(layer.w2.clone(), layer.w2_scale.clone())
        c = layer.config
        return dict(rw=layer.router_weight.clone(), rb=layer.router_bias.clone(), w1=w1, pc1=pc1,
                    b1=layer.w13_bias.float().clone(), w2=w2, pc2=pc2, b2=layer.w2_bias.float().clone(), k=c.top_k,
                    act=self._fused(c.swiglu_alpha, c.swiglu_limit))

    def forward(self, L: dict, x):
        logits = self.F.linear(x, L["rw"], L["rb"])
        rdata, gather, scatter = self.routing(logits, L["k"], sm_first=False)
        h = self.matmul_ogs(x, L["w1"], L["b1"], rdata, gather_indx=gather, precision_config=L["pc1"],
                            fused_activation=L["act"])
        return self.matmul_ogs(h, L["w2"], L["b2"], rdata, scatter_indx=scatter, precision_config=L["pc2"],
                               gammas=rdata.gate_scal)


def load(peer_dir: str | None) -> tuple[Peer | None, str]:
    """(the peer, "") or (None, why it is not in this run)."""
    if not peer_dir:
        return None, "no --peer given"
    if not os.path.isdir(os.path.join(peer_dir, "triton_kernels")):
        return None, f"{peer_dir}/triton_kernels not found (bash ../shared/peers/get_triton_kernels.sh {peer_dir})"
    try:
        return Peer(peer_dir), ""
    except Exception as e:  # noqa: BLE001 - an import failure of the peer is reported in the table, not fatal
        return None, f"triton_kernels did not import ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
