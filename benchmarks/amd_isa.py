"""What the ROCm modules run, read from their ISA, and a static roofline: no AMD GPU needed (none was used).

    python benchmarks/amd_isa.py [--models 'gpt-oss-20b;128,8,2048,768'] [--archs gfx942,gfx950] [--tokens 1,64,2048]
    python benchmarks/amd_isa.py --numerics [--models ...] [--tokens 1,16,64]

For each model (a preset name or ``E,k,H,I``) and arch (and gfx950's ``activations="mxfp8"``): compiles the layer
with IREE's executable dumps (~10 s each), then prints

* every dispatch with its instruction mix (``mxmoe.compiler.rocm_isa``): MFMA / scaled MFMA, vector FMAs, VALU,
  hardware conversions, global loads by width; the expert dispatches (the ``matmul_like`` contractions) marked;
* per expert dispatch: the tile IREE chose (rows x columns per workgroup, K per loop iteration, threads), and one
  iteration of its K loop per thread: matrix instructions, VALU instructions, the VALU per weight value (all of the
  loop's VALU: the decode, address arithmetic, packing), and the global loads of each binding (weights, scales,
  activations; traced through the LLVM IR);
* a static roofline per expert GEMM (up: N = 2I, K = H; down: N = H, K = I; padded as the target pads) at each token
  count: row blocks (the bound the module dispatches and the mean under uniform routing), HBM bytes (every block
  reads its expert's packed weights and scales once per row tile, its activation rows once, writes its f32 rows),
  matrix FLOPs executed (block rows, padding included) and VALU work, the time each takes at the device's peaks
  (below) and the bound, the largest; the layer's sum of the two GEMMs' bounds. Peaks (dense, AMD's data sheets):

  ========  ==========  ===============  =================  =====================================
  device    HBM         bf16 MFMA        scaled MFMA (fp8)  VALU (CUs x 64 lanes x clock)
  ========  ==========  ===============  =================  =====================================
  MI300X    5.3 TB/s    1307 TFLOP/s     -                  304 x 64 x 2.1 GHz = 40.9 T ops/s
  MI355X    8.0 TB/s    2516 TFLOP/s     5033 TFLOP/s       256 x 64 x 2.4 GHz = 39.3 T ops/s
  ========  ==========  ===============  =================  =====================================

``--numerics``: instead, each form's error against the bf16 reference (and the mxfp8 form's against the reference
that quantizes the same way), the rocm lowering compiled for this CPU (llvm-cpu, the same linalg).

The estimate assumes perfect overlap of memory, matrix and VALU work and full occupancy; it ignores the other
dispatches (router, block layout, unsort: ~30 small ones, a few microseconds each on a real device), L2 / MALL hits
for blocks of one expert and the occupancy of decode-sized grids (docs/amd.md).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

DEVICES = {"gfx942": dict(name="MI300X", hbm=5.3e12, bf16=1307e12, fp8=None, valu=304 * 64 * 2.1e9),
           "gfx950": dict(name="MI355X", hbm=8.0e12, bf16=2516e12, fp8=5033e12, valu=256 * 64 * 2.4e9)}
LOADS = ("load_x4", "load_x2", "load_dword", "load_short", "load_byte")


def model_config(name: str):
    from mxmoe.core.config import MoEConfig, preset

    if "," in name:
        e, k, h, i = (int(v) for v in name.split(","))
        return MoEConfig(num_experts=e, top_k=k, hidden=h, intermediate=i)
    return preset(name)


def compile_dump(cfg, arch: str, activations: str, out: Path):
    import mxmoe
    from mxmoe.torch_frontend import MoE

    layer = MoE.random(cfg, seed=0)
    return mxmoe.compile(layer, target=f"rocm:{arch}", activations=activations,
                         extra_flags=[f"--iree-hal-dump-executable-files-to={out}"])


def expected_blocks(e: int, k: int, t: int, rows: int, trials: int = 32) -> float:
    """Mean of sum_e ceil(count_e / rows) for t tokens routed uniformly to k distinct experts of e."""
    rng = np.random.default_rng(0)
    total = 0
    for _ in range(trials):
        ids = np.argpartition(rng.random((t, e)), k - 1, axis=1)[:, :k] if k < e else np.tile(np.arange(e), (t, 1))
        counts = np.bincount(ids.ravel(), minlength=e)
        total += int(np.sum(-(-counts // rows)))
    return total / trials


def dispatch_stats(name: str, lines: list[str], tiles: dict, loop_loads: dict) -> dict:
    """The expert dispatch's tile and one K-loop iteration per thread (see the module docstring)."""
    from mxmoe.compiler import rocm_isa

    t = tiles.get(name, {})
    wg = t.get("workgroup", [1, 0, 0, 0, 0])
    threads = math.prod(t.get("workgroup_size", [1]))
    loop = rocm_isa.main_loop(lines)
    m = rocm_isa.mix(loop)
    # K per iteration: the workgroup's matrix instructions (each wave of 64 threads issues the loop's) cover its
    # rows x cols x K_step; one 16x16xKi instruction covers 16 * 16 * Ki
    shapes = [tuple(map(int, g)) for g in re.findall(r"v_mfma(?:_scale)?_f32_(\d+)x(\d+)x(\d+)", "\n".join(loop))]
    per = shapes[0][0] * shapes[0][1] * shapes[0][2] if shapes else 0
    k_step = len(shapes) * (threads // 64) * per // (wg[1] * wg[2]) if wg[1] * wg[2] else 0
    values = wg[2] * k_step / threads           # weight values a thread decodes per iteration
    return {"rows": wg[1], "cols": wg[2], "k_step": k_step, "threads": threads, "mfma": m["mfma"] + m["mfma_scale"],
            "valu": m["valu"], "values": values, "valu_per_value": m["valu"] / values if values else float("nan"),
            "loads": {role: dict(sorted(c.items())) for role, c in sorted(loop_loads.get(name, {}).items())}}


def report(model: str, arch: str, activations: str, tokens: list[int]) -> None:
    from mxmoe.compiler import rocm_isa
    from mxmoe.compiler.passes.lowering import rocm_grouped

    cfg = model_config(model)
    dev = DEVICES[arch]
    with tempfile.TemporaryDirectory() as d:
        cm = compile_dump(cfg, arch, activations, Path(d))
        kernels = rocm_isa.kernels(d)
        loop_loads = rocm_isa.binding_loads(d, loop=True)
        tiles = rocm_isa.workgroup_tiles(d)
    experts = rocm_isa.expert_dispatches(kernels)
    print(f"\n## {model} on rocm:{arch} ({dev['name']}), activations={activations}: {len(kernels)} dispatches, "
          f"{len(experts)} of them expert GEMMs\n")
    print("| dispatch | MFMA | scaled MFMA | vector FMA | VALU | cvt_scale | global loads x4/x2/dword/short/byte |")
    print("|---|---|---|---|---|---|---|")
    for name, lines in kernels.items():
        m = rocm_isa.mix(lines)
        mark = " **expert**" if name in experts else ""
        print(f"| {rocm_isa.short_name(name)[:64]}{mark} | {m['mfma']} | {m['mfma_scale']} | {m['vector_fma']} | "
              f"{m['valu']} | {m['cvt_scale']} | {'/'.join(str(m[w]) for w in LOADS)} |")
    print("\nExpert dispatches: the tile, and one K-loop iteration per thread (global loads: count x bytes, by "
          "binding):\n")
    print("| expert dispatch | rows x cols / workgroup | K / iteration | threads | MFMA | VALU | weight values | "
          "VALU / value | global loads per binding |")
    print("|---|---|---|---|---|---|---|---|---|")
    stats = {}
    for name, lines in experts.items():
        st = stats[name] = dispatch_stats(name, lines, tiles, loop_loads)
        by = "; ".join(f"{role}: " + " + ".join(f"{n}x{b}B" for b, n in c.items()) for role, c in st["loads"].items())
        print(f"| {rocm_isa.short_name(name)[:58]} | {st['rows']}x{st['cols']} | {st['k_step']} | {st['threads']} | "
              f"{st['mfma']} | {st['valu']} | {st['values']:g} | {st['valu_per_value']:.1f} | {by} |")
    roofline(cfg, arch, activations, tokens, cm.target.passes()[3][1], stats, rocm_grouped)


def roofline(cfg, arch: str, activations: str, tokens: list[int], pad: str, stats: dict, rocm_grouped) -> None:
    dev = DEVICES[arch]
    up = lambda v: -(-v // int(pad)) * int(pad)  # noqa: E731
    e, k = cfg.num_experts, cfg.top_k
    gemms = {"up": (2 * up(cfg.intermediate), up(cfg.hidden)), "down": (up(cfg.hidden), up(cfg.intermediate))}
    peak_mm = dev["fp8"] if activations == "mxfp8" else dev["bf16"]
    act_bytes = 1 + 1 / 32 if activations == "mxfp8" else 2
    print(f"\nStatic roofline ({dev['name']}: {dev['hbm'] / 1e12:.1f} TB/s, {peak_mm / 1e12:.0f} TFLOP/s matrix, "
          f"{dev['valu'] / 1e12:.1f} T VALU ops/s; blocks: the bound / the mean under uniform routing; times in us "
          "from the mean):\n")
    print("| GEMM | T | rows/block | blocks | HBM MB | matrix GFLOP (useful) | VALU G ops | t HBM | t matrix | t VALU | "
          "bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    layer = {t: 0.0 for t in tokens}
    for gname, (n, kk) in gemms.items():
        for t in tokens:
            s = t * k
            mb = rocm_grouped.LARGE_BLOCK_ROWS if s >= rocm_grouped.LARGE_BLOCK_MIN_ROWS * e else rocm_grouped.BLOCK_ROWS
            mm = min(e, s)
            nb = mm + (s - mm) // mb
            nb_mean = expected_blocks(e, k, t, mb)
            st = next((v for name, v in stats.items() if f"_Dx{mb}x{n}x{kk // 32}x32" in name), None)
            if st is None:
                print(f"| {gname} {n}x{kk} | {t} | {mb} | no dispatch of this shape found |")
                continue
            row_tiles = -(-mb // st["rows"]) if st["rows"] else 1      # workgroups along a block's rows
            weights = nb_mean * row_tiles * n * kk * (0.5 + 1 / 32)
            hbm = weights + nb_mean * mb * kk * act_bytes + nb_mean * mb * n * 4
            flops = 2.0 * nb_mean * mb * n * kk
            valu = nb_mean * row_tiles * n * kk * st["valu_per_value"]
            times = {"HBM": hbm / dev["hbm"], "matrix": flops / peak_mm, "VALU": valu / dev["valu"]}
            bound = max(times, key=times.get)
            layer[t] += times[bound]
            print(f"| {gname} {n}x{kk} | {t} | {mb} | {nb} / {nb_mean:.1f} | {hbm / 1e6:.1f} | {flops / 1e9:.2f} "
                  f"({2.0 * s * n * kk / 1e9:.2f}) | {valu / 1e9:.2f} | {times['HBM'] * 1e6:.1f} | "
                  f"{times['matrix'] * 1e6:.1f} | {times['VALU'] * 1e6:.1f} | {bound} |")
    print("\nExpert GEMMs of the layer (up + down bounds): "
          + ", ".join(f"T={t}: {v * 1e6:.1f} us" for t, v in layer.items()))


def numerics(model: str, tokens: list[int]) -> None:
    """The error of each rocm form, compiled for this CPU, against the bf16 reference (and the mxfp8 form against the
    reference that quantizes its activations the same way): max |out - ref| / max |ref| (the tests' measure) and
    ||out - ref|| / ||ref||, random layer (``MoE.random``), x ~ N(0, 1) in bf16."""
    import ml_dtypes
    import torch

    import mxmoe
    from mxmoe.core.reference import numpy_reference, relative_error
    from mxmoe.torch_frontend import MoE
    from mxmoe.compiler.targets import rocm_form_on_cpu

    cfg = model_config(model)
    layer = MoE.random(cfg, seed=0)
    w8 = layer.to_weights()
    print(f"\n## {model}: error of the rocm forms (compiled for this CPU) against the bf16 reference\n")
    print("| form | T | max rel. err vs bf16 ref | RMS rel. err vs bf16 ref | max rel. err vs its own ref |")
    print("|---|---|---|---|---|")
    for arch, act in (("gfx942", "bf16"), ("gfx950", "bf16"), ("gfx950", "mxfp8")):
        cm = mxmoe.compile(layer, target=rocm_form_on_cpu(arch, act))
        for t in tokens:
            x = torch.randn(t, cfg.hidden, generator=torch.Generator().manual_seed(t)).bfloat16()
            out = cm(x).float().numpy()
            ref = numpy_reference(w8, x.float().numpy(), ml_dtypes.bfloat16)
            own = numpy_reference(w8, x.float().numpy(), ml_dtypes.bfloat16, activations=act)
            rms = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
            print(f"| {arch} {act} | {t} | {relative_error(out, ref):.2e} | {rms:.2e} | "
                  f"{relative_error(out, own):.2e} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt-oss-20b;128,8,2048,768", help="';'-separated presets or E,k,H,I")
    ap.add_argument("--archs", default="gfx942,gfx950")
    ap.add_argument("--tokens", default="1,64,2048")
    ap.add_argument("--no-mxfp8", action="store_true", help="skip gfx950's activations='mxfp8' form")
    ap.add_argument("--numerics", action="store_true",
                    help="instead: each form's error against the reference, its linalg compiled for this CPU")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.numerics:
        for model in args.models.split(";"):
            numerics(model, tokens)
        print("\n(the rocm lowering compiled for this CPU: the same linalg, not an AMD GPU)")
        return 0
    for model in args.models.split(";"):
        for arch in args.archs.split(","):
            if arch not in DEVICES:
                ap.error(f"--archs: {arch!r} is none of {', '.join(DEVICES)}")
            report(model, arch, "bf16", tokens)
            if arch == "gfx950" and not args.no_mxfp8:
                report(model, arch, "mxfp8", tokens)
    print("\n(static estimate from the compiled ISA; nothing here ran on an AMD GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
