import sys, dataclasses, torch, triton
sys.path.insert(0, "/work/main/tests")
from test_triton_kernels import make_layer
from mxmoe.runtime.triton_kernels import TileConfig, ROW_MAJOR
from mxmoe.runtime.triton_kernels.moe import plan_moe_forward
def bench(T, cfgs):
    x, lg, w = make_layer(T, 32, 2880, 2880, seed=1)
    for cfg in cfgs:
        try:
            plan = plan_moe_forward(x, lg, *w, top_k=4, config=cfg)
            for l in plan.launches: l.launch()
            t = {l.name: triton.testing.do_bench(l.launch, warmup=10, rep=40) * 1e3 for l in plan.launches[2:4]}
            print(T, cfg, " ".join(f"{k}={v:.1f}" for k, v in t.items()), flush=True)
        except Exception as e:
            print(T, cfg, "ERR", str(e)[:100], flush=True)
C = TileConfig
bench(1, [C(16, n, k, wp, st) for n, k, wp, st in [(64,256,4,4),(32,256,4,4),(128,256,4,3),(64,512,4,3),(32,512,4,3),(64,128,4,4),(16,512,4,4),(64,256,8,4)]])
bench(64, [C(16, n, k, wp, st) for n, k, wp, st in [(64,256,4,4),(128,256,4,3),(128,128,4,4),(64,128,4,4),(256,128,8,3)]] + [C(32,128,128,4,4)])
bench(1024, [C(m, n, k, wp, st) for m, n, k, wp, st in [(64,128,128,4,3),(64,128,128,8,3),(64,256,128,8,3),(128,128,128,8,3),(128,256,64,8,3),(128,128,256,8,2),(64,128,256,4,3)]])
bench(4096, [C(m, n, k, wp, st) for m, n, k, wp, st in [(128,128,128,8,3),(128,256,128,8,3),(128,256,64,8,4),(128,128,128,4,4),(64,256,128,8,3)]])
x, lg, w = make_layer(4096, 32, 2880, 2880, seed=1)
plan = plan_moe_forward(x, lg, *w, top_k=4)
g = plan.launches[1]; plan.launches[0].launch()
for chunk, wp in [(256, 8), (128, 4), (512, 8), (512, 16), (1024, 16)]:
    l = dataclasses.replace(g, constexprs={**g.constexprs, "CHUNK": chunk}, num_warps=wp)
    print("group", chunk, wp, "%.1f" % (triton.testing.do_bench(l.launch, warmup=5, rep=30) * 1e3), flush=True)
