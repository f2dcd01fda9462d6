"""CPU benchmark: one gpt-oss-20b MoE layer compiled by mxmoe (target "cpu") vs an eager torch baseline.

    .venv/bin/python benchmarks/cpu_moe.py [--tokens 1,8,64,512] [--repeats 7] [--threads 2]

Per token count (random inputs, random router => close to uniform routing) it prints:
  mxmoe ms     median of warm runs of the compiled module (IREE llvm-cpu, local-task)
  torch ms     median of warm runs of the baseline, measured in the same process: route with torch ops, then
               for each *selected* expert only: dequantize its MXFP4 weights with a 256-entry byte table
               (two values per lookup) and the block scales, and run the rows routed to it through
               ``torch.matmul`` (oneDNN), GLU, second matmul, weighted combine. The matmuls run in bf16 or
               fp32, whichever is faster on this machine (--baseline-dtype picks one), so the baseline is a
               good eager implementation, not a naive loop.
  ratio        torch ms / mxmoe ms (> 1: mxmoe is faster)
  experts      distinct experts the routing selected (what both implementations must read)
  weight MB    MXFP4 bytes of those experts (values + scales + biases): the bytes that must move
  GB/s, %bw    weight MB / mxmoe time, and that as a share of this machine's copy bandwidth (measured
               here with a numpy copy of a 512 MB buffer, counting bytes read + written)
  bound ms     weight MB / bandwidth: the time to stream the weights once
It also checks mxmoe's output against the torch baseline (relative max error).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import numpy as np
import torch

import mxmoe
from mxmoe.core.config import PRESETS
from mxmoe.torch_frontend.moe import MoE

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def measure_bandwidth(mb: int = 512, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s (read + write) of a numpy copy; the best of ``repeats``."""
    a = np.ones(mb * 2**20 // 8, dtype=np.float64)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


def _top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k with ties to the lower expert index: mxmoe's rule (bf16 logits tie often at 512 tokens)."""
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


class TorchBaseline:
    """Eager MoE forward that dequantizes only the selected experts, then matmuls through oneDNN."""

    def __init__(self, moe: MoE, dtype: torch.dtype):
        self.m, self.dtype = moe, dtype
        lut = torch.tensor(E2M1, dtype=dtype)
        # byte -> (low-nibble value, high-nibble value), packed in one integer: one index_select per byte
        pair = torch.stack([lut[torch.arange(256) & 15], lut[torch.arange(256) >> 4]], dim=-1).contiguous()
        self.pair_table = pair.view(torch.int32 if dtype == torch.bfloat16 else torch.int64).reshape(256)

    def dequant(self, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        n, kh = w.shape
        vals = torch.index_select(self.pair_table, 0, w.reshape(-1).to(torch.int32)).view(self.dtype)
        # 2^(s-127) as f32 bits (exact for bytes 1..254, which is all that quantizing finite weights gives)
        scale = (s.to(torch.int32) << 23).view(torch.float32).to(self.dtype)
        return vals.view(n, kh * 2 // 32, 32).mul_(scale[..., None]).view(n, kh * 2)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, cfg = self.m, self.m.config
        logits = torch.nn.functional.linear(x, m.router_weight, m.router_bias).float()
        if cfg.routing == "topk_softmax":
            vals, ids = _top_k(logits, cfg.top_k)
            weights = torch.softmax(vals, dim=-1)
        else:
            weights, ids = _top_k(torch.softmax(logits, dim=-1), cfg.top_k)
            if cfg.renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(x.shape[0], cfg.hidden, dtype=torch.float32)
        xd = x.to(self.dtype)
        flat = ids.reshape(-1)
        for e in torch.unique(flat).tolist():
            slots = (flat == e).nonzero().squeeze(1)
            tok = slots // cfg.top_k
            w13 = self.dequant(m.w13[e], m.w13_scale[e])
            h = (xd[tok] @ w13.t()).float()
            if m.w13_bias is not None:
                h = h + m.w13_bias[e].float()
            h = h.to(x.dtype).float()
            gate, up = (h[:, 0::2], h[:, 1::2]) if cfg.interleaved else h.chunk(2, dim=-1)
            if cfg.activation == "swiglu_oai":
                gate = gate.clamp(max=cfg.swiglu_limit)
                up = up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
                a = (up + 1) * gate * torch.sigmoid(cfg.swiglu_alpha * gate)
            else:
                a = up * gate * torch.sigmoid(gate)
            w2 = self.dequant(m.w2[e], m.w2_scale[e])
            y = (a.to(x.dtype).to(self.dtype) @ w2.t()).float()
            if m.w2_bias is not None:
                y = y + m.w2_bias[e].float()
            y = y.to(x.dtype).float()
            out.index_add_(0, tok, y * weights.reshape(-1)[slots, None])
        return out.to(x.dtype)


def median_time(fn, repeats: int, warm: int = 1) -> float:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,8,64,512")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--baseline-dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = PRESETS[args.preset]
    moe = MoE.random(cfg, seed=0)
    load = os.getloadavg()
    print(f"preset {args.preset}: E={cfg.num_experts} k={cfg.top_k} H={cfg.hidden} I={cfg.intermediate}; "
          f"torch {torch.__version__} threads={torch.get_num_threads()}; load avg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True, text=True).stdout.strip()
    print(f"cpu: {cpu.split(':', 1)[-1].strip()} x {os.cpu_count()}")
    bw = measure_bandwidth()
    print(f"measured copy bandwidth: {bw / 1e9:.1f} GB/s (read + write)")
    t0 = time.perf_counter()
    cm = mxmoe.compile(moe, target="cpu")
    print(f"compile: {time.perf_counter() - t0:.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in cm.timings.items())})")

    per_expert = sum(getattr(moe, n)[0].numel() * getattr(moe, n).element_size()
                     for n in ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias") if getattr(moe, n) is not None)
    dtypes = [torch.bfloat16, torch.float32] if args.baseline_dtype == "auto" else [getattr(torch, args.baseline_dtype)]
    baselines = {d: TorchBaseline(moe, d) for d in dtypes}
    g = torch.Generator().manual_seed(1)
    header = (f"{'tokens':>6} {'experts':>7} {'weight MB':>9} {'mxmoe ms':>9} {'torch ms':>9} {'(dtype)':>8} {'ratio':>6} "
              f"{'GB/s':>6} {'%bw':>5} {'bound ms':>8} {'rel err':>8}")
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16)
        logits = torch.nn.functional.linear(x, moe.router_weight, moe.router_bias).float()
        n_exp = len(torch.unique(_top_k(logits, cfg.top_k)[1]))
        out = cm(x)
        t_mx = median_time(lambda: cm(x), args.repeats)
        best = None
        for d, base in baselines.items():
            ref = base(x)
            t = median_time(lambda: base(x), max(3, args.repeats // 2 if T >= 512 else args.repeats))
            if best is None or t < best[0]:
                best = (t, d, ref)
        t_torch, d_torch, ref = best
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        nbytes = n_exp * per_expert
        row = (f"{T:>6} {n_exp:>7} {nbytes / 1e6:>9.1f} {t_mx * 1e3:>9.2f} {t_torch * 1e3:>9.2f} "
               f"{str(d_torch).replace('torch.', ''):>8} {t_torch / t_mx:>6.2f} {nbytes / t_mx / 1e9:>6.2f} "
               f"{100 * nbytes / t_mx / bw:>5.1f} {nbytes / bw * 1e3:>8.2f} {err:>8.1e}")
        rows.append(row)
        print(row if len(rows) > 1 else header + "\n" + row, flush=True)
    load = os.getloadavg()
    print(f"load avg after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
