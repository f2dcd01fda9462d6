import sys, torch
sys.path.insert(0, "/work/main/tests")
from test_triton_kernels import make_layer, reference_moe
from mxmoe.runtime.triton_kernels import moe_forward, ROW_MAJOR, COL_MAJOR, TileConfig
x, lg, w = make_layer(64, 32, 512, 768, seed=1)
ref = reference_moe(x, lg, *w, top_k=4).float()
for lay in (COL_MAJOR, ROW_MAJOR):
    a, sa = lay.swizzle(w[0], w[1]); b, sb = lay.swizzle(w[3], w[4])
    for cfg in [TileConfig(16, 64, 256, 4, 1), TileConfig(16, 64, 256, 4, 2), TileConfig(16, 64, 256, 4, 4),
                TileConfig(64, 128, 128, 4, 1), TileConfig(64, 128, 128, 4, 3), TileConfig(16, 64, 64, 4, 3)]:
        out = moe_forward(x, lg, a, sa, w[2], b, sb, w[5], top_k=4, layout=lay, config=cfg).float()
        print(lay.name, cfg, "maxdiff %.3g" % (out - ref).abs().max().item(), flush=True)
