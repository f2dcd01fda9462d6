import sys, torch, triton
sys.path.insert(0, "/work/main/tests")
from test_triton_kernels import make_layer
from mxmoe.runtime.triton_kernels import moe_forward, ROW_MAJOR, COL_MAJOR
from mxmoe.runtime.triton_kernels.moe import plan_moe_forward
for T in (1, 64, 1024, 4096):
    x, lg, w = make_layer(T, 32, 2880, 2880, seed=1)
    for lay in (ROW_MAJOR, COL_MAJOR):
        a, sa = lay.swizzle(w[0], w[1]); b, sb = lay.swizzle(w[3], w[4])
        args = (x, lg, a, sa, w[2], b, sb, w[5])
        f = lambda: moe_forward(*args, top_k=4, layout=lay)
        ms = triton.testing.do_bench(f, warmup=25, rep=100)
        plan = plan_moe_forward(*args, top_k=4, layout=lay)
        per = {}
        for l in plan.launches:
            per[l.name] = triton.testing.do_bench(l.launch, warmup=10, rep=50) * 1e3
        flops = 2 * T * 4 * 2880 * (5760 + 2880)
        print(f"T={T} {lay.name}: {ms*1e3:.1f} us total, {flops/ms/1e9:.1f} TFLOP/s; " + ", ".join(f"{k}={v:.1f}" for k, v in per.items()), flush=True)
