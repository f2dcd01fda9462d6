"""Compile ws_mxfp4_gemm variants for sm_90 without a GPU; save cubin/ptx/metadata/sass."""
import json, os, subprocess, sys, glob
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
import wsgemm

HERE = os.path.dirname(os.path.abspath(__file__))
#: the cubins and their metadata: build/gluon_ws/out of the repository (git-ignored), carried to the device
OUT_DIR = os.path.join(HERE, "..", "..", "build", "gluon_ws", "out")
N, K = 5760, 2880
VARIANTS = {
    "abl_nodec_bn256": (256, 4, 4, 3, 4, False, 168, 128, 1),
    "abl_nomma_bn256": (256, 4, 4, 3, 4, False, 168, 128, 2),
    # name: (BN, NX, NR, ND, DEC_WARPS, WIDE, maxnreg, DEC_REGS)
    "bn256_d4_wide": (256, 4, 4, 3, 4, True, 168, 128),
    "bn256_d4_fast": (256, 4, 4, 3, 4, False, 168, 128),
    "bn128_d8_fast": (128, 4, 6, 4, 8, False, 128, 96),
    "bn256_d4_fast_nr8": (256, 4, 8, 3, 4, False, 168, 128),
    "bn256_d4_fast_nr6_nd4_lfence": (256, 4, 6, 4, 4, False, 168, 128, 3),
    "bn256_d4_wide_nr6_nd4_lfence": (256, 4, 6, 4, 4, True, 168, 128, 3),
    "bn256_d4_fast_nr6_nd4": (256, 4, 6, 4, 4, False, 168, 128),
    "bn128_d4_fast": (128, 4, 6, 4, 4, False, 168, 128),
}


def desc_type(dtype, block, layout):
    return f"tensordesc<{dtype}[{','.join(map(str, block))}],{repr(layout)}>"


def compile_variant(name, cfg):
    BN, NX, NR, ND, DW, WIDE, maxnreg, decregs = cfg[:8]
    ablate = cfg[8] if len(cfg) > 8 else 0
    raw_rows = BN
    srows = 2 * BN // 256
    x_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    scale_bias = 126 if WIDE else 62  # WIDE: f = 2^(s-127) after a 2^126 multiply; FAST: f = 2^(s-65), out *= 2^64
    out_scale = 1.0 if WIDE else 2.0 ** 64
    fn = wsgemm.ws_mxfp4_gemm
    sig = {"x_desc": desc_type("bf16", [64, 64], x_layout), "w_desc": desc_type("u8", [raw_rows, 32], w_layout),
           "s_desc": desc_type("u8", [srows, 256], w_layout), "out_ptr": "*bf16"}
    consts = dict(N=N, K=K, BN=BN, NX=NX, NR=NR, ND=ND, DEC_WARPS=DW, WIDE=WIDE,
                  SCALE_BIAS=(0 if WIDE else scale_bias), OUT_SCALE=out_scale, DEC_REGS=decregs, ABLATE=ablate)
    if WIDE:
        consts["SCALE_BIAS"] = 0  # bf16 bits of 2^(s-127) are s << 7
    for k in consts:
        sig[k] = "constexpr"
    attrs = {(3,): [["tt.divisibility", 16]]}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))
    md = ck.metadata
    d = os.path.join(OUT_DIR, name)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "kernel.cubin"), "wb").write(ck.asm["cubin"])
    open(os.path.join(d, "kernel.ptx"), "w").write(ck.asm["ptx"])
    open(os.path.join(d, "kernel.ttgir"), "w").write(ck.asm["ttgir"])
    meta = {"function": md.name, "num_warps": int(md.num_warps), "num_ctas": int(getattr(md, "num_ctas", 1)),
            "shared": int(md.shared), "global_scratch_size": int(getattr(md, "global_scratch_size", 0) or 0),
            "global_scratch_align": int(getattr(md, "global_scratch_align", 1) or 1),
            "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0) or 0),
            "tensordesc_meta": getattr(md, "tensordesc_meta", None),
            "cfg": dict(BN=BN, NX=NX, NR=NR, ND=ND, DEC_WARPS=DW, WIDE=WIDE, maxnreg=maxnreg, DEC_REGS=decregs,
                        RAW_ROWS=raw_rows, SROWS=srows, ABLATE=ablate, OUT_SCALE=out_scale), "triton": triton.__version__}
    json.dump(meta, open(os.path.join(d, "meta.json"), "w"), indent=1, default=str)
    nvdis = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm"))[0]
    sass = subprocess.run([nvdis, "-c", "-hex", os.path.join(d, "kernel.cubin")], capture_output=True, text=True)
    open(os.path.join(d, "kernel.sass"), "w").write(sass.stdout + sass.stderr)
    print(name, json.dumps({k: meta[k] for k in ("function", "num_warps", "shared", "global_scratch_size")}))


if __name__ == "__main__":
    names = sys.argv[1:] or list(VARIANTS)
    for n in names:
        try:
            compile_variant(n, VARIANTS[n])
        except Exception as ex:
            print(n, "FAILED:", str(ex).splitlines()[0][:300], [l for l in str(ex).splitlines() if "fatal" in l][:2])
