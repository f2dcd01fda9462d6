"""On the H200: load the Gluon cubins with ctypes, check vs torch, time vs torch.bmm (and mxmoe via subprocess)."""
import ctypes, json, os, statistics, subprocess, sys, traceback
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
#: the cubins and their metadata: build/gluon_ws/out of the repository (git-ignored), carried to the device
OUT_DIR = os.path.join(HERE, "..", "..", "build", "gluon_ws", "out")
sys.path.insert(0, HERE)
from bitlayout import stored_bit_map  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
E, M, N, K = 32, 64, 5760, 2880
KS = K // 64
FLOP = 2 * E * M * N * K
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
lib = ctypes.CDLL("libcuda.so.1")
lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
    ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
report = {}


def check(r, what):
    if r != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(r, ctypes.byref(msg))
        raise RuntimeError(f"{what}: {r} {msg.value}")


class TMap:
    """A 128-byte CUtensorMap (64-byte aligned host memory) for a 2-D row-major tensor."""

    def __init__(self, t, dtype_code, box_rows, box_cols, swizzle):
        self.raw = ctypes.create_string_buffer(128 + 64)
        self.addr = (ctypes.addressof(self.raw) + 63) // 64 * 64
        rows, cols = t.shape
        es = t.element_size()
        dims = (ctypes.c_uint64 * 2)(cols, rows)
        strides = (ctypes.c_uint64 * 1)(cols * es)
        box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
        estr = (ctypes.c_uint32 * 2)(1, 1)
        check(lib.cuTensorMapEncodeTiled(ctypes.c_void_p(self.addr), dtype_code, 2, ctypes.c_void_p(t.data_ptr()),
                                         dims, strides, box, estr, 0, swizzle, 2, 0), "cuTensorMapEncodeTiled")
        self.shape = (rows, cols)
        self.strides = (cols, 1)

    def params(self):
        vals = [ctypes.c_int32(self.shape[0]), ctypes.c_int32(self.shape[1]),
                ctypes.c_int64(self.strides[0]), ctypes.c_int64(self.strides[1])]
        return [ctypes.c_void_p(self.addr)], vals  # the map is passed by value: its address is the param pointer


class Kernel:
    def __init__(self, d):
        self.meta = json.load(open(os.path.join(d, "meta.json")))
        cubin = open(os.path.join(d, "kernel.cubin"), "rb").read()
        self.module, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        img = ctypes.create_string_buffer(cubin, len(cubin))
        check(lib.cuModuleLoadData(ctypes.byref(self.module), img), "cuModuleLoadData")
        check(lib.cuModuleGetFunction(ctypes.byref(self.fn), self.module, self.meta["function"].encode()),
              "cuModuleGetFunction")
        check(lib.cuFuncSetAttribute(self.fn, 8, ctypes.c_int(self.meta["shared"])), "cuFuncSetAttribute")
        regs = ctypes.c_int()
        lib.cuFuncGetAttribute(ctypes.byref(regs), 4, self.fn)  # CU_FUNC_ATTRIBUTE_NUM_REGS
        self.regs = regs.value

    def prepare(self, maps, out, grid):
        vals, ptrs = [], []
        for m in maps:
            p, v = m.params()
            ptrs.append(p[0].value)
            vals.append(None)
            for x in v:
                vals.append(x)
        self._keep = []
        addrs = []
        for m in maps:
            addrs.append(m.addr)
            for x in m.params()[1]:
                self._keep.append(x)
                addrs.append(ctypes.addressof(x))
        for x in (ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(0), ctypes.c_void_p(0)):
            self._keep.append(x)
            addrs.append(ctypes.addressof(x))
        self.params = (ctypes.c_void_p * len(addrs))(*addrs)
        self.grid = grid

    def __call__(self):
        stream = torch.cuda.current_stream().cuda_stream
        check(lib.cuLaunchKernel(self.fn, self.grid[0], self.grid[1], 1, 32 * self.meta["num_warps"], 1, 1,
                                 self.meta["shared"], ctypes.c_void_p(stream), self.params, None), "cuLaunchKernel")


def bench(fn, iters=100, warm=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    per = sorted(s.elapsed_time(e) * 1e3 for s, e in ev)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return {"median_us": statistics.median(per), "min_us": per[0], "p90_us": per[int(0.9 * len(per))],
            "b2b_mean_us": s.elapsed_time(e) * 1e3 / iters}


# ------------------------------------------------------------------ data
g = torch.Generator(device=dev).manual_seed(0)
Wv = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev, generator=g)
Ws = torch.randint(118, 131, (E, N, K // 32), dtype=torch.uint8, device=dev, generator=g)
X = torch.randn(E * M, K, device=dev, generator=g).to(torch.bfloat16)
TAB = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], device=dev)


def codes_of(e):
    w = Wv[e]
    return torch.stack([w & 15, w >> 4], -1).reshape(N, K)  # low nibble = even k


Wdeq = torch.empty(E, N, K, dtype=torch.float32, device=dev)
for e in range(E):
    c = codes_of(e).long()
    v = TAB[c & 7] * torch.where((c & 8) > 0, -1.0, 1.0)
    Wdeq[e] = v * torch.exp2(Ws[e].float() - 127).repeat_interleave(32, dim=1)
Xe = X.view(E, M, K)
ref = torch.bmm(Xe.float(), Wdeq.transpose(1, 2))  # fp32 [E, M, N]
ref_max = ref.abs().max().item()
Wbf = Wdeq.to(torch.bfloat16)
assert torch.equal(Wbf.float(), Wdeq), "dequantized weights not exact in bf16"
del Wdeq
torch.cuda.empty_cache()
POS = stored_bit_map()


def pack(BN):
    NT = (N + BN - 1) // BN
    Np = NT * BN
    SR = 2 * BN // 256
    wp = torch.empty(E, NT, KS, BN, 8, dtype=torch.int32, device=dev)
    sp = torch.full((E, Np, K // 32), 127, dtype=torch.uint8, device=dev)
    sp[:, :N] = Ws
    for e in range(E):
        c = torch.zeros(Np, K, dtype=torch.int64, device=dev)
        c[:N] = codes_of(e).long()
        c = c.view(Np, K // 8, 8)
        word = torch.zeros(Np, K // 8, dtype=torch.int64, device=dev)
        for k in range(8):
            for b in range(4):
                word |= ((c[:, :, k] >> b) & 1) << POS[(k, b)]
        word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
        wp[e] = word.view(NT, BN, KS, 8).permute(0, 2, 1, 3)
    wbytes = wp.view(torch.uint8).reshape(E * NT * KS * BN, 32)
    sbytes = sp.view(E, NT, BN, KS, 2).permute(0, 1, 3, 2, 4).contiguous().reshape(E * NT * KS * SR, 256)
    return NT, SR, wbytes, sbytes


def run_variant(name, packs):
    d = os.path.join(OUT_DIR, name)
    kern = Kernel(d)
    cfg = kern.meta["cfg"]
    BN = cfg["BN"]
    if BN not in packs:
        packs[BN] = pack(BN)
    NT, SR, wbytes, sbytes = packs[BN]
    out = torch.empty(E * M, N, dtype=torch.bfloat16, device=dev)
    out.fill_(float("nan"))
    xm = TMap(X, 9, 64, 64, 3)
    wm = TMap(wbytes, 0, BN, 32, 0)
    sm = TMap(sbytes, 0, SR, 256, 0)
    kern.prepare([xm, wm, sm], out, (NT, E))
    kern()
    torch.cuda.synchronize()
    o = out.view(E, M, N).float()
    err = (o - ref).abs().max().item()
    t = bench(kern)
    r = {"cfg": cfg, "regs": kern.regs, "shared": kern.meta["shared"], "nan": bool(torch.isnan(o).any().item()),
         "max_abs_err_rel": err / ref_max, "mean_abs_err_rel": (o - ref).abs().mean().item() / ref_max,
         **t, "tflops_median": FLOP / (t["median_us"] * 1e-6) / 1e12}
    # bf16-rounding floor: the exact fp32 result rounded to bf16
    r["bf16_round_floor_rel"] = (ref.to(torch.bfloat16).float() - ref).abs().max().item() / ref_max
    print(name, json.dumps(r), flush=True)
    return r


packs = {}
names = sys.argv[1:] or sorted(os.listdir(os.path.join(OUT_DIR)))
for n in names:
    try:
        report[n] = run_variant(n, packs)
    except Exception:
        report[n] = {"error": traceback.format_exc()[-2000:]}
        print(n, "ERROR", report[n]["error"], flush=True)
packs.clear()
torch.cuda.empty_cache()

# ---- dense reference: bf16 bmm with pre-dequantized W^T [32, 2880, 5760]
try:
    WT = Wbf.transpose(1, 2).contiguous()
    del Wbf
    outd = torch.empty(E, M, N, dtype=torch.bfloat16, device=dev)
    fn = lambda: torch.bmm(Xe, WT, out=outd)
    fn()
    torch.cuda.synchronize()
    t = bench(fn)
    report["torch_bmm_bf16"] = {**t, "tflops_median": FLOP / (t["median_us"] * 1e-6) / 1e12,
                                "max_abs_err_rel": (outd.float() - ref).abs().max().item() / ref_max}
    print("torch_bmm_bf16", json.dumps(report["torch_bmm_bf16"]), flush=True)
    WTn = WT.transpose(1, 2)  # [E, N, K] contiguous = the TN form
    WTn = WTn.contiguous()
    del WT
    fn2 = lambda: torch.bmm(Xe, WTn.transpose(1, 2), out=outd)
    t = bench(fn2)
    report["torch_bmm_bf16_TN"] = {**t, "tflops_median": FLOP / (t["median_us"] * 1e-6) / 1e12}
    print("torch_bmm_bf16_TN", json.dumps(report["torch_bmm_bf16_TN"]), flush=True)
except Exception:
    report["torch_bmm_bf16"] = {"error": traceback.format_exc()[-2000:]}
    print(report["torch_bmm_bf16"])
json.dump(report, open(os.path.join(OUT, "device_report.json"), "w"), indent=1)
