"""What the ROCm modules run, read from their ISA, and a static roofline: no AMD GPU needed (none was used).

    python benchmarks/amd_isa.py [--models 'gpt-oss-20b;128,8,2048,768'] [--archs gfx942,gfx950] [--tokens 1,64,2048]

For each model and arch (and gfx950's ``activations="mxfp8"``): compiles the layer with IREE's executable dumps,
then prints

* every dispatch with its instruction mix (``mxmoe.compiler.rocm_isa``): MFMA / scaled MFMA, vector FMAs, VALU,
  loads by width; the expert dispatches (``matmul_like``) marked;
* per expert dispatch, its K loop (the loop holding the matrix instructions: two K steps of 64 for the layouts IREE
  picks here): MFMAs, VALU instructions, the loads by width, and what each binding (weights, scales, activations) is
  read with (the LLVM IR); the decode's VALU per weight value;
* a static roofline per expert GEMM at each token count: blocks (the bound the module dispatches, and the expected
  number under uniform routing), weight bytes read (every block reads its expert's packed weights and scales),
  matrix FLOPs executed (16- or 64-row blocks, padding rows included), decode VALU work, and the time each would
  take at the device's peaks (below): the largest is the bound. Peaks (dense, from AMD's data sheets):

  ========  ==========  ===============  =================  =====================================
  device    HBM         bf16 MFMA        scaled MFMA (fp8)  VALU (CUs x 64 lanes x clock)
  ========  ==========  ===============  =================  =====================================
  MI300X    5.3 TB/s    1307 TFLOP/s     -                  304 x 64 x 2.1 GHz = 40.9 T ops/s
  MI355X    8.0 TB/s    2516 TFLOP/s     5033 TFLOP/s       256 x 64 x 2.4 GHz = 39.3 T ops/s
  ========  ==========  ===============  =================  =====================================

The estimate assumes perfect overlap and full occupancy; it ignores the dispatch overheads (the layer is ~27
dispatches, most of them the router's and the block layout's: a few microseconds each on a real device), L2 / MALL
hits for blocks of one expert, and the occupancy of decode-sized grids (see docs/amd.md).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

DEVICES = {"gfx942": dict(name="MI300X", hbm=5.3e12, bf16=1307e12, fp8=None, valu=304 * 64 * 2.1e9),
           "gfx950": dict(name="MI355X", hbm=8.0e12, bf16=2516e12, fp8=5033e12, valu=256 * 64 * 2.4e9)}
#: decode instructions that each produce a known number of weight values (values per thread = count x this)
DECODE_MARKERS = {r"\bv_cvt_scalef32_pk_bf16_fp4\b": 2, r"\bv_cvt_f32_ubyte0": 1, r"\bv_lshrrev_b64\b": 1}


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


def expected_blocks(e: int, k: int, t: int, rows: int, trials: int = 64) -> float:
    """Mean of sum_e ceil(count_e / rows) for t tokens routed uniformly to k distinct experts of e."""
    rng = np.random.default_rng(0)
    total = 0
    for _ in range(trials):
        ids = np.argsort(rng.random((t, e)), axis=1)[:, :k]
        counts = np.bincount(ids.ravel(), minlength=e)
        total += int(np.sum(-(-counts // rows)))
    return total / trials


def loop_stats(lines: list[str]) -> dict:
    from mxmoe.compiler import rocm_isa

    loop = rocm_isa.main_loop(lines)
    m = rocm_isa.mix(loop)
    values = sum(per * sum(1 for ln in loop if re.search(pat, ln)) for pat, per in DECODE_MARKERS.items())
    loads = {w: m[w] for w in ("load_x4", "load_x2", "load_dword", "load_short", "load_byte") if m[w]}
    return {"mfma": m["mfma"] + m["mfma_scale"], "valu": m["valu"], "loads": loads, "values": values,
            "valu_per_value": m["valu"] / values if values else float("nan")}


def report(model: str, arch: str, activations: str, tokens: list[int]) -> None:
    from mxmoe.compiler import rocm_isa
    from mxmoe.compiler.passes.lowering import rocm_grouped

    cfg = model_config(model)
    dev = DEVICES[arch]
    with tempfile.TemporaryDirectory() as d:
        cm = compile_dump(cfg, arch, activations, Path(d))
        kernels = rocm_isa.kernels(d)
        loads = rocm_isa.binding_loads(d)
    print(f"\n## {model} on rocm:{arch} ({dev['name']}), activations={activations}: {len(kernels)} dispatches\n")
    print("| dispatch | MFMA | scaled MFMA | vector FMA | VALU | loads x4/x2/dword/short/byte |")
    print("|---|---|---|---|---|---|")
    experts = rocm_isa.expert_dispatches(kernels)
    for name, lines in kernels.items():
        m = rocm_isa.mix(lines)
        mark = " **expert**" if name in experts else ""
        ld = "/".join(str(m[w]) for w in ("load_x4", "load_x2", "load_dword", "load_short", "load_byte"))
        print(f"| {rocm_isa.short_name(name)[:64]}{mark} | {m['mfma']} | {m['mfma_scale']} | {m['vector_fma']} | "
              f"{m['valu']} | {ld} |")
    print("\nK loop of each expert dispatch (per thread, one loop iteration):\n")
    print("| expert dispatch | MFMA | VALU | loads | weight values decoded | VALU / value | bytes per load, by binding |")
    print("|---|---|---|---|---|---|---|")
    stats = {}
    for name, lines in experts.items():
        st = loop_stats(lines)
        stats[name] = st
        by = "; ".join(f"{role}: " + ",".join(f"{n}x{b}B" for b, n in sorted(c.items()))
                       for role, c in sorted(loads.get(name, {}).items()) if role != "indices")
        print(f"| {rocm_isa.short_name(name)[:58]} | {st['mfma']} | {st['valu']} | {st['loads']} | {st['values']} | "
              f"{st['valu_per_value']:.1f} | {by} |")
    # static roofline per grouped matmul (up: N = 2I, K = H; down: N = H, K = I), padded as the target pads
    pad = cm.target.passes()[3][1]
    mult = int(pad)
    up = lambda v: -(-v // mult) * mult  # noqa: E731
    e, k = cfg.num_experts, cfg.top_k
    gemms = {"up": (2 * up(cfg.intermediate), up(cfg.hidden)), "down": (up(cfg.hidden), up(cfg.intermediate))}
    peak_mm = dev["fp8"] if activations == "mxfp8" else dev["bf16"]
    print(f"\nStatic roofline ({dev['name']}: {dev['hbm'] / 1e12:.1f} TB/s, {peak_mm / 1e12:.0f} TFLOP/s matrix, "
          f"{dev['valu'] / 1e12:.1f} T VALU ops/s; time in us; bound = the largest):\n")
    print("| GEMM | T | rows/block | blocks (bound / expected) | weight MB read | matrix GFLOP | decode GVALU | "
          "t HBM | t matrix | t VALU | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for gname, (n, kk) in gemms.items():
        for t in tokens:
            s = t * k
            mb = rocm_grouped.LARGE_BLOCK_ROWS if s >= rocm_grouped.LARGE_BLOCK_MIN_ROWS * e else rocm_grouped.BLOCK_ROWS
            mm = min(e, s)
            nb = mm + (s - mm) // mb
            nb_exp = expected_blocks(e, k, t, mb)
            tag = f"_Dx{mb}x{n}x{kk // 32}x32"
            st = next((v for kname, v in stats.items() if tag in kname), None)
            vpv = st["valu_per_value"] if st and st["values"] else float("nan")
            wbytes = nb_exp * n * kk * (0.5 + 1 / 32)
            flops = 2.0 * nb_exp * mb * n * kk
            valu = nb_exp * n * kk * vpv
            times = {"HBM": wbytes / dev["hbm"], "matrix": flops / peak_mm, "VALU": valu / dev["valu"]}
            bound = max(times, key=times.get)
            print(f"| {gname} {n}x{kk} | {t} | {mb} | {nb} / {nb_exp:.1f} | {wbytes / 1e6:.1f} | {flops / 1e9:.2f} | "
                  f"{valu / 1e9:.2f} | {times['HBM'] * 1e6:.1f} | {times['matrix'] * 1e6:.1f} | "
                  f"{times['VALU'] * 1e6:.1f} | {bound} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt-oss-20b;128,8,2048,768")
    ap.add_argument("--archs", default="gfx942,gfx950")
    ap.add_argument("--tokens", default="1,64,2048")
    ap.add_argument("--no-mxfp8", action="store_true", help="skip gfx950's activations='mxfp8' form")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    for model in args.models.split(";"):
        for arch in args.archs.split(","):
            report(model, arch, "bf16", tokens)
            if arch == "gfx950" and not args.no_mxfp8:
                report(model, arch, "mxfp8", tokens)
    print("\n(static estimate from the compiled ISA; nothing here ran on an AMD GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
