"""Sharded MoE layers over torch.distributed: per-rank compute and collective time, bytes, scaling efficiency.

    python benchmarks/distributed_moe.py                       # gloo on this machine's CPUs, 1/2/4 ranks
    python benchmarks/distributed_moe.py --ranks 1,2 --tokens 1,64,512 --layers gpt-oss-120b-small
    python benchmarks/distributed_moe.py --paper                # the model on paper for 2/4/8 H100/H200s

Each run spawns N processes (gloo, a file store), shards the same layer (``mxmoe.distributed.shard``) and feeds each
rank T/N tokens (strong scaling: the same T in all). Per row: the slowest rank's time per forward (median of
``--iters``), the collectives' part of it (median of ``--iters`` more forwards that time each collective to its end:
``ShardedMoE.sync_timing``; on GPUs a collective otherwise only enqueues), the rest (routing, the experts, the sums,
Python), bytes it handed to and got from the collectives, and
the scaling efficiency ``t(1 rank) / (N * t(N ranks))``. CPUs here are 2 shared vCPUs: at 4 ranks the processes
share them, so the efficiency there measures the machine, not the method; the layers are gpt-oss-120b's and
DeepSeek-V3's routing (E, k) with H and I cut to fit (``*-small``).

On GPUs (NCCL, one process a GPU, the real shapes: ``--layers gpt-oss-120b,deepseek-v3``), in two steps, since GPU
machines have no compiler:

    python benchmarks/distributed_moe.py --build build/dist_parts --ranks 1,2 --mode ep   # here: each cut's part
    python benchmarks/distributed_moe.py --plans build/dist_parts --ranks 1,2 --mode ep   # there: NCCL, cuda:R

``--build`` compiles one rank's part of each layer for each rank count (all ranks' parts have the same shapes) for
``--target`` (default cuda:sm_90) and writes it as an artifact without weights; ``--plans`` gives each rank the same
random layer (seed 0), cuts its part (``mxmoe.distributed.shard_weights``), binds it to the artifact
(``mxmoe.runtime.load(..., weights=)``) on its GPU and times the forward with the device synchronized around it;
the collectives' share is timed with a synchronization around each (``ShardedMoE.sync_timing``).
"""

from __future__ import annotations

import argparse
import contextlib
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
#: the real shapes, for the paper model (and on GPUs, as the presets of the same names)
REAL = {"gpt-oss-120b": (128, 4, 2880, 2880, 0), "deepseek-v3": (256, 8, 7168, 2048, 2048)}


def _layer(name: str):
    """A small layer of LAYERS, or a preset (the real shapes: GPU runs)."""
    from mxmoe.core.config import MoEConfig, preset
    from mxmoe.torch_frontend import MoE

    if name not in LAYERS:
        return MoE.random(preset(name), seed=0)
    e, k, h, i, extra = LAYERS[name]
    return MoE.random(MoEConfig(num_experts=e, top_k=k, hidden=h, intermediate=i, **extra), seed=0)


def _cut(mode, world: int) -> tuple[int, int]:
    from mxmoe.distributed import parse_mode

    return parse_mode(mode if world > 1 else "ep", world)


def _part_path(plans: str, name: str, ep: int, tp: int) -> str:
    return os.path.join(plans, f"{name}.ep{ep}.tp{tp}.mxmoe")


def build(args) -> None:
    """Compile one rank's part of each layer for each rank count, as an artifact without weights (compiler machine)."""
    import mxmoe
    from mxmoe.distributed import ShardedMoE, ShardSpec

    os.makedirs(args.build, exist_ok=True)
    for name in args.layers:
        layer = _layer(name)
        for world in args.ranks:
            ep, tp = _cut(args.mode, world)
            part = ShardedMoE(layer, ShardSpec(ep, tp, 0))
            t0 = time.perf_counter()
            cm = mxmoe.compile(part.local, target=args.target, entries=part.entries)
            path = _part_path(args.build, name, ep, tp)
            cm.save(path, weights="external")
            print(f"{path}: {args.target}, entries {part.entries}, {time.perf_counter() - t0:.0f} s", flush=True)


def _gpu_part(args, name: str, layer, ep: int, tp: int, rank: int, tmp: str):
    """This rank's part of ``layer`` bound to the built artifact on GPU ``rank``."""
    import mxmoe.runtime
    from mxmoe.core.safetensors import write_safetensors
    from mxmoe.distributed import ShardedMoE, ShardSpec, shard_weights
    from mxmoe.runtime.artifact import Artifact

    spec = ShardSpec(ep, tp, rank)
    path = _part_path(args.plans, name, ep, tp)
    fields = Artifact(path).manifest["model"]["parameters"]
    weights = shard_weights(layer.to_weights(), spec)
    file = os.path.join(tmp, f"{name}.rank{rank}.safetensors")
    write_safetensors(file, {param: getattr(weights, field) for field, param in fields.items()
                             if getattr(weights, field) is not None})
    module = mxmoe.runtime.load(path, f"cuda:{rank}", weights=file)
    os.unlink(file)
    router = {k: getattr(layer, k) for k in ("router_weight", "router_bias", "score_bias")
              if getattr(layer, k, None) is not None}  # the part moves it to the tokens' device
    return ShardedMoE.from_compiled(layer.config, layer.dtype, spec, module, router, dispatch=args.dispatch)


def _worker(rank, world, init, args, results):
    gpu = bool(args.plans)
    if gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=init, rank=rank, world_size=world,
                            **({"device_id": torch.device("cuda", rank)} if gpu else {}))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from mxmoe.distributed import shard

    def sync():
        if gpu:
            torch.cuda.synchronize()

    out = {}
    for name in args.layers:
        layer = _layer(name)
        if gpu:
            with tempfile.TemporaryDirectory() as tmp:
                sharded = _gpu_part(args, name, layer, *_cut(args.mode, world), rank, tmp)
        else:
            sharded = shard(layer, args.mode if world > 1 else "ep", dispatch=args.dispatch)
            if args.target != "eager":
                sharded.compile(args.target)
        for t in args.tokens:
            n = t // world + (rank < t % world)
            x = torch.randn(n, layer.config.hidden).bfloat16()
            if gpu:
                x = x.cuda()
            sharded(x)  # warm-up
            times, comm = [], []
            for timing in (False, True):  # the forward as it runs, then with each collective timed to its end
                sharded.sync_timing = timing
                for _ in range(args.iters):
                    sharded.stats.update(bytes_sent=0, bytes_received=0, collective_s=0.0)
                    sync()
                    dist.barrier()
                    t0 = time.perf_counter()
                    sharded(x)
                    sync()
                    if timing:
                        comm.append(sharded.stats["collective_s"])
                    else:
                        times.append(time.perf_counter() - t0)
            out[(name, t)] = (statistics.median(times), statistics.median(comm), sharded.stats["bytes_sent"],
                              sharded.stats["bytes_received"])
            if t in args.profile:  # where rank 0's forward goes (torch.profiler, 5 forwards; every rank runs them)
                sharded.sync_timing = False
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
                with torch.profiler.profile(activities=acts) if rank == 0 else contextlib.nullcontext() as prof:
                    for _ in range(5):
                        sharded(x)
                    sync()
                if rank == 0:
                    print(f"rank 0 of {world}, {name}, T={t}, 5 forwards:\n" + prof.key_averages().table(
                        sort_by="cpu_time_total", row_limit=18, max_name_column_width=50), flush=True)
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
    p.add_argument("--target", default=None, help="mxmoe target of each shard, or 'eager' for the torch reference "
                   "(default: cpu; with --build cuda:sm_90)")
    p.add_argument("--build", metavar="DIR", help="compile each cut's part for --target into DIR and exit (a machine "
                   "with the compiler; for a GPU machine's --plans)")
    p.add_argument("--plans", metavar="DIR", help="parts built by --build: run on this machine's GPUs with NCCL, one "
                   "process a GPU")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--paper", action="store_true", help="print the GPU model on paper and exit")
    p.add_argument("--profile", default="", help="token counts at which rank 0 prints a torch.profiler table")
    args = p.parse_args()
    if args.paper:
        paper()
        return
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.profile = [int(t) for t in args.profile.split(",") if t]
    args.layers = args.layers.split(",")
    if ":" in args.mode:
        ep, tp = args.mode.split(":")
        args.mode = {"ep": int(ep), "tp": int(tp)}
    args.ranks = ranks = [int(r) for r in args.ranks.split(",")]
    args.target = args.target or ("cuda:sm_90" if args.build else "cpu")
    if args.build:
        build(args)
        return
    if args.plans and torch.cuda.device_count() < max(ranks):
        sys.exit(f"--plans: {max(ranks)} ranks need as many GPUs, this machine has {torch.cuda.device_count()}")
    where = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, NCCL {torch.cuda.nccl.version()}, parts "
             f"from {args.plans}" if args.plans else f"target {args.target}")
    print(f"load average before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; mode {args.mode}, "
          f"dispatch {args.dispatch}; {where}")
    base = {}
    print("| layer | T | ranks | time ms (slowest rank) | rest ms | collectives ms (timed apart) | MB sent / received "
          "per rank | efficiency |")
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
