"""Sharded MoE layers over torch.distributed: per-rank compute and collective time, bytes, scaling efficiency.

    python benchmarks/distributed_moe.py                       # gloo on this machine's CPUs, 1/2/4 ranks
    python benchmarks/distributed_moe.py --ranks 1,2 --tokens 1,64,512 --layers gpt-oss-120b-small
    python benchmarks/distributed_moe.py --paper                # the model on paper for 2/4/8 H100/H200s

Each run spawns N processes (gloo, a file store), shards the same layer (``mxmoe.distributed.shard``) and feeds each
rank T/N tokens (strong scaling: the same T in all). Per row: the slowest rank's time per forward (median of
``--iters``), its compute part (the rest is the collectives), bytes it handed to and got from the collectives, and
the scaling efficiency ``t(1 rank) / (N * t(N ranks))``. CPUs here are 2 shared vCPUs: at 4 ranks the processes
share them, so the efficiency there measures the machine, not the method; the layers are gpt-oss-120b's and
DeepSeek-V3's routing (E, k) with H and I cut to fit (``*-small``). The GPU numbers are the paper model (``--paper``)
until a machine with several GPUs is lent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS = {
    # (E, k, H, I, extra config)
    "gpt-oss-120b-small": (128, 4, 256, 256, {}),
    "deepseek-v3-small": (256, 8, 256, 128, {"activation": "silu", "interleaved": False, "bias": False,
                                              "routing": "softmax_topk", "renormalize": True,
                                              "shared_intermediate": 128}),
}
#: the real shapes, for the paper model
REAL = {"gpt-oss-120b": (128, 4, 2880, 2880, 0), "deepseek-v3": (256, 8, 7168, 2048, 2048)}


def _layer(name: str):
    from mxmoe.core.config import MoEConfig
    from mxmoe.torch_frontend import MoE

    e, k, h, i, extra = LAYERS[name]
    return MoE.random(MoEConfig(num_experts=e, top_k=k, hidden=h, intermediate=i, **extra), seed=0)


def _worker(rank, world, init, args, results):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from mxmoe.distributed import shard

    out = {}
    for name in args.layers:
        layer = _layer(name)
        sharded = shard(layer, args.mode if world > 1 else "ep", dispatch=args.dispatch)
        if args.target != "eager":
            sharded.compile(args.target)
        for t in args.tokens:
            n = t // world + (rank < t % world)
            x = torch.randn(n, layer.config.hidden).bfloat16()
            sharded(x)  # warm-up
            times, comm = [], []
            for _ in range(args.iters):
                sharded.stats.update(bytes_sent=0, bytes_received=0, collective_s=0.0)
                dist.barrier()
                t0 = time.perf_counter()
                sharded(x)
                times.append(time.perf_counter() - t0)
                comm.append(sharded.stats["collective_s"])
            out[(name, t)] = (statistics.median(times), statistics.median(comm), sharded.stats["bytes_sent"],
                              sharded.stats["bytes_received"])
    results[rank] = out
    dist.destroy_process_group()


def run(world: int, args) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m, tempfile.TemporaryDirectory() as d:
        results = m.dict()
        procs = [ctx.Process(target=_worker, args=(r, world, f"file://{d}/init", args, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
        return dict(results)


def paper() -> None:
    """Per-GPU bytes and time from the single-GPU decode/prefill rates measured on the H100 (docs/nvidia.md),
    plus the exchange at NVLink's 450 GB/s per direction and ~15 us per collective."""
    link, latency, hbm_eff, flops = 450e9, 15e-6, 2.2e12, 400e12  # B/s; s; bytes/s reached in decode; FLOP/s prefill
    print("| layer | T | GPUs | mode | weight GB/GPU read | FLOP/GPU | exchange MB/GPU | t compute us | t comm us |"
          " efficiency |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (e, k, h, i, s) in REAL.items():
        per_expert = (2 * i * h + h * i) * (0.5 + 1 / 32)
        for t in (1, 64, 512, 4096, 16384):
            used = min(e, t * k)  # distinct experts touched (uniform routing, upper bound)
            flop = 2 * t * k * 3 * h * i + (2 * t * 3 * h * s if s else 0)
            t1 = max(used * per_expert / hbm_eff, flop / flops)
            for n in (2, 4, 8):
                for mode in ("ep", "tp"):
                    rd = used * per_expert / n if mode == "tp" else min(e // n, t * k) * per_expert
                    ex = t * h * (2 + 4) * (n - 1) / n  # tokens out (bf16), partials back (fp32)
                    tc = max(rd / hbm_eff, flop / n / flops)
                    tm = 2 * latency + ex / link
                    eff = t1 / (n * (tc + tm))
                    print(f"| {name} | {t} | {n} | {mode} | {rd / 1e9:.3f} | {flop / n:.2e} | {ex / 1e6:.2f} | "
                          f"{tc * 1e6:.1f} | {tm * 1e6:.1f} | {eff:.0%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--tokens", default="1,64,512,4096,16384")
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--mode", default="ep", help="ep, tp (or ep+tp as ep:tp, e.g. 2:2)")
    p.add_argument("--dispatch", default="auto", choices=("auto", "allgather", "all_to_all"))
    p.add_argument("--target", default="cpu", help="mxmoe target of each shard, or 'eager' for the torch reference")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--paper", action="store_true", help="print the GPU model on paper and exit")
    args = p.parse_args()
    if args.paper:
        paper()
        return
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.layers = args.layers.split(",")
    if ":" in args.mode:
        ep, tp = args.mode.split(":")
        args.mode = {"ep": int(ep), "tp": int(tp)}
    ranks = [int(r) for r in args.ranks.split(",")]
    print(f"load average before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; mode {args.mode}, "
          f"dispatch {args.dispatch}, target {args.target}")
    base = {}
    print("| layer | T | ranks | time ms (slowest rank) | compute ms | collectives ms | MB sent / received per rank |"
          " efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    for world in ranks:
        res = run(world, args)
        for name in args.layers:
            for t in args.tokens:
                rows = [res[r][(name, t)] for r in range(world)]
                slow = max(rows, key=lambda r: r[0])
                if world == 1:
                    base[(name, t)] = slow[0]
                eff = base.get((name, t), float("nan")) / (world * slow[0])
                print(f"| {name} | {t} | {world} | {slow[0] * 1e3:.2f} | {(slow[0] - slow[1]) * 1e3:.2f} | "
                      f"{slow[1] * 1e3:.2f} | {slow[2] / 1e6:.2f} / {slow[3] / 1e6:.2f} | {eff:.0%} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
