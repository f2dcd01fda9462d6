"""The README's main job: compile a gpt-oss-20b-shaped MoE layer for the CPU, run it, check it.

``python -m mxmoe.demo [--preset NAME] [--tokens N] [--seed S]``. Exits non-zero if the compiled
layer disagrees with the plain-torch reference beyond bf16 tolerance.
"""

from __future__ import annotations

import argparse
import sys
import time


def relative_error(out, ref) -> float:
    """max |out - ref| / max |ref|, in fp32."""
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mxmoe.demo", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default="cpu")
    args = p.parse_args(argv)

    import torch

    import mxmoe
    from mxmoe.torch_frontend import MoE

    t0 = time.perf_counter()
    layer = MoE.random(args.preset, seed=args.seed, dtype=torch.bfloat16)
    c = layer.config
    print(f"layer: {args.preset} (E={c.num_experts}, k={c.top_k}, H={c.hidden}, I={c.intermediate}), "
          f"random MXFP4 weights, built in {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    compiled = mxmoe.compile(layer, target=args.target)
    print(f"compiled for {compiled.target.name} in {time.perf_counter() - t0:.1f} s "
          f"({', '.join(f'{k} {v:.2f}' for k, v in compiled.timings.items())})")

    x = torch.randn(args.tokens, c.hidden, generator=torch.Generator().manual_seed(args.seed + 1)).to(torch.bfloat16)
    t0 = time.perf_counter()
    out = compiled(x)
    run_s = time.perf_counter() - t0
    ref = layer(x)
    err = relative_error(out, ref)
    ok = err < 2e-2
    print(f"ran {args.tokens} tokens in {run_s * 1e3:.1f} ms; max relative error vs reference {err:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
