"""CPU benchmark: one gpt-oss-20b MoE layer (router included) compiled by mxmoe (target "cpu"), side by side
with llama.cpp's CPU backend (ggml) running the same layer.

    .venv/bin/python benchmarks/cpu_moe.py [--tokens 1,4,8,64,512] [--threads 2] [--rounds 3] [--repeats 9]
        [--peer llamacpp] [--scaling 512,4096,32768,262144] [--timeline 1] [--torch] [--activations mxint8]

The peer: ``bash ../shared/peers/llamacpp/build.sh build/peers/llamacpp`` builds ggml (from the llama.cpp that
llama-cpp-python 0.3.36 vendors: Release, native, OpenMP, weight repack on as llama.cpp runs by default) and
``moe_bench``, the same layer as a ggml graph (its header lists the ops). With ``--peer llamacpp`` (the default
when it is built) each round times mxmoe at every token count, then runs ``moe_bench`` once for all of them,
with the same thread count, asking it for inputs whose routing touches the same number of distinct experts as
mxmoe's did (``--experts T:n``), so both read the same weight bytes. The machine is shared and noisy, so the
rounds alternate the two and the table reports the median over rounds of each round's median, the spread
(min-max of the round medians), and the load average before and after; a second table has the fastest single
call of each (other jobs only ever add time, so the fastest call is the least disturbed one).

Columns:
  experts      distinct experts the routing selected (what both implementations must read)
  weight MB    MXFP4 bytes of those experts (values + scales + biases)
  llama.cpp ms moe_bench's median time (ggml_backend_graph_compute of the whole layer)
  mxmoe ms     median time of a call of the compiled module from Python (torch tensor in and out: the
               runtime call included)
  ratio        llama.cpp ms / mxmoe ms, the median of the rounds' ratios (> 1: mxmoe is faster)
  bound ms     weight MB / the machine's read bandwidth at this thread count (measured below): the time to
               stream the weights once; x bound: mxmoe ms / bound ms
  GFLOP/s      2 x (routed rows x (2I x H + H x I)) / mxmoe time: the expert GEMMs' arithmetic rate;
               % peak: of the measured peak of the instruction the kernel's GEMM uses (tdpbf16ps on an AMX
               host, whose items of 5 rows or fewer take vdpbf16ps; vdpbf16ps on an AVX512-BF16 host, vpmaddwd
               otherwise; with --activations mxint8: vpdpbusd on an AVX512-VNNI host,
               counting a multiply-add as 2 ops like the others; mxint16: half that peak, each multiply-add
               taking two, one per int8 plane) at this thread count
  rel err      max |out - ref| / max |ref| against the bf16 reference (the torch layer); with --activations mxint8
               (mxint16) also "exact err", against the reference whose matmuls read MXINT8 (MXINT16) activations as
               the module's do
The peaks and the read bandwidth come from benchmarks/cpu_peak.c (built here with the host's C compiler).

``--scaling``: the per-token cost of a smaller layer (``--scaling-config``, default E=32 k=4 H=I=512: the
gpt-oss-20b layer's intermediates at 262144 tokens would not fit this machine's memory) at each token count:
flat means a total cost linear in tokens. ``--timeline T``: where one call's time goes at T tokens, per
dispatch (IREE's host-execution profile of the same module through iree-benchmark-module), and the Python
call around it. ``--torch``: the previous eager torch baseline as a column (slow at 512 tokens).
``--cold N``: mxmoe's calls again with the weights from DRAM, as in a model (N copies of them at other addresses,
called in turn): on a host whose last-level cache holds the few experts of a small T, the main table's calls find
them there (both sides alike), the bound column is the DRAM's.
``--activations mxint8`` / ``mxint16``: time the module compiled with that ``activations=`` (int8 activations or
15-bit ones as two int8 planes, the rows16 weight layout, docs/cpu.md) instead of the default bf16 one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
PEER_BIN = REPO / "build" / "peers" / "llamacpp" / "moe_bench"
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


# ------------------------------------------------------------------------------------------ machine
def machine_peaks(threads: int) -> dict[tuple[str, int], float]:
    """{(name, threads): G/s} of benchmarks/cpu_peak.c, and ("read_bw", threads): GB/s."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "cpu_peak"
        subprocess.run([cc, "-O2", "-march=native", "-pthread", str(REPO / "benchmarks" / "cpu_peak.c"), "-o", str(exe)],
                       check=True)
        out = subprocess.run([str(exe), str(threads)], capture_output=True, text=True, check=True).stdout
    peaks = {}
    for line in out.splitlines():
        parts = line.split()
        if parts[0] == "peak":
            peaks[(parts[1], int(parts[2]))] = float(parts[3])
        elif parts[0] == "read_bw":
            peaks[("read_bw", int(parts[1]))] = float(parts[2])
    return peaks


def instruction_peak(peaks: dict, name: str, threads: int) -> float | None:
    """The ``threads``-thread peak of instruction ``name`` that "% peak" divides by: the measured one, or ``threads``
    times the 1-thread one where the measurement came out lower (another job held a core then: the 2-thread
    vpdpbusd run has measured 486 of 946 G op/s; dividing by it printed 112% "of peak"). Said when it happens."""
    measured, one = peaks.get((name, threads)), peaks.get((name, 1))
    if measured is None or one is None or measured >= threads * one * 0.9:
        return measured
    print(f"  ({name} at {threads} threads measured {measured:.1f}, under {threads} x its 1-thread {one:.1f}: a core was "
          f"busy; % peak uses {threads * one:.1f})")
    return threads * one


def set_threads(threads: int, runtime_flags: list[str] = ()) -> None:
    """IREE's local-task workers and any other runtime flags (before the first module loads), torch's threads."""
    import iree.runtime as rt

    rt.flags.parse_flags(f"--task_topology_max_group_count={threads}", *runtime_flags)
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ layers
def _top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k with ties to the lower expert index: mxmoe's rule (bf16 logits tie often at 512 tokens)."""
    from mxmoe.torch_frontend.ties import top_k

    return top_k(x, k)


class TorchBaseline:
    """Eager MoE forward that dequantizes only the selected experts, then matmuls through oneDNN."""

    def __init__(self, moe, dtype: torch.dtype):
        self.m, self.dtype = moe, dtype
        lut = torch.tensor(E2M1, dtype=dtype)
        # byte -> (low-nibble value, high-nibble value), packed in one integer: one index_select per byte
        pair = torch.stack([lut[torch.arange(256) & 15], lut[torch.arange(256) >> 4]], dim=-1).contiguous()
        self.pair_table = pair.view(torch.int32 if dtype == torch.bfloat16 else torch.int64).reshape(256)

    def dequant(self, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        n, kh = w.shape
        vals = torch.index_select(self.pair_table, 0, w.reshape(-1).to(torch.int32)).view(self.dtype)
        scale = (s.to(torch.int32) << 23).view(torch.float32).to(self.dtype)
        return vals.view(n, kh * 2 // 32, 32).mul_(scale[..., None]).view(n, kh * 2)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, cfg = self.m, self.m.config
        logits = torch.nn.functional.linear(x, m.router_weight, m.router_bias).float()
        if cfg.routing == "topk_softmax":
            vals, ids = _top_k(logits, cfg.top_k)
            weights = torch.softmax(vals, dim=-1)
        else:
            weights, ids = _top_k(torch.softmax(logits, dim=-1), cfg.top_k)
            if cfg.renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(x.shape[0], cfg.hidden, dtype=torch.float32)
        xd = x.to(self.dtype)
        flat = ids.reshape(-1)
        for e in torch.unique(flat).tolist():
            slots = (flat == e).nonzero().squeeze(1)
            tok = slots // cfg.top_k
            h = (xd[tok] @ self.dequant(m.w13[e], m.w13_scale[e]).t()).float()
            if m.w13_bias is not None:
                h = h + m.w13_bias[e].float()
            h = h.to(x.dtype).float()
            gate, up = (h[:, 0::2], h[:, 1::2]) if cfg.interleaved else h.chunk(2, dim=-1)
            if cfg.activation == "swiglu_oai":
                gate = gate.clamp(max=cfg.swiglu_limit)
                up = up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
                a = (up + 1) * gate * torch.sigmoid(cfg.swiglu_alpha * gate)
            else:
                a = up * gate * torch.sigmoid(gate)
            y = (a.to(x.dtype).to(self.dtype) @ self.dequant(m.w2[e], m.w2_scale[e]).t()).float()
            if m.w2_bias is not None:
                y = y + m.w2_bias[e].float()
            out.index_add_(0, tok, y.to(x.dtype).float() * weights.reshape(-1)[slots, None])
        return out.to(x.dtype)


def timed(fn, repeats: int, warm: int = 2) -> float:
    """Median seconds of ``repeats`` calls after ``warm``."""
    return statistics.median(timings(fn, repeats, warm))


def timings(fn, repeats: int, warm: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` calls after ``warm``."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def inputs(cfg, T: int) -> torch.Tensor:
    return torch.randn(T, cfg.hidden, generator=torch.Generator().manual_seed(1000 + T)).to(torch.bfloat16)


def distinct_experts(moe, x: torch.Tensor) -> int:
    logits = torch.nn.functional.linear(x, moe.router_weight, moe.router_bias).float()
    return len(torch.unique(_top_k(logits, moe.config.top_k)[1]))


def run_peer(binary: Path, tokens: list[int], experts: dict[int, int], threads: int,
             repeats: int) -> dict[int, tuple[float, float]]:
    """moe_bench's (median, min) ms per token count (repack mode), each T's inputs chosen to touch experts[T]."""
    cmd = [str(binary), "--tokens", ",".join(map(str, tokens)), "--threads", str(threads), "--repeats", str(repeats),
           "--warm", "2", "--mode", "repack", "--experts", ",".join(f"{t}:{experts[t]}" for t in tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    res = {}
    for line in out.splitlines():
        m = re.match(r"repack\s+(\d+)\s+(\d+)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)", line)
        if m:
            T, n = int(m.group(1)), int(m.group(2))
            if n != experts[T]:
                print(f"  (llama.cpp at {T} tokens touched {n} experts, not {experts[T]})", file=sys.stderr)
            res[T] = float(m.group(3)), float(m.group(4))
    return res


def expert_flops(cfg, T: int) -> float:
    return 2.0 * T * cfg.top_k * (2 * cfg.intermediate * cfg.hidden + cfg.hidden * cfg.intermediate)


def spread(v: list[float]) -> str:
    return f"{min(v):.2f}-{max(v):.2f}"


# ------------------------------------------------------------------------------------------ timeline
def timeline(cm, cfg, T: int, threads: int, repeats: int, runtime_flags: list[str] = ()) -> None:
    """Per-dispatch host-execution times of one call (iree-benchmark-module + iree-profile), grouped."""
    from mxmoe.runtime.artifact import irpa_writer

    tools = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as d:
        vmfb, params = Path(d) / "m.vmfb", Path(d) / "w.irpa"
        vmfb.write_bytes(cm.vmfb)
        os.replace(irpa_writer(cm.parameters, d), params)
        x = inputs(cfg, T)
        x.view(torch.int16).numpy().tofile(Path(d) / "x.bin")
        prof = Path(d) / "p.ireeprof"
        base = [str(tools / "iree-benchmark-module"), f"--module={vmfb}", f"--parameters=model={params}",
                "--device=local-task", f"--function={cm.entries[0].name}", f"--input={T}x{cfg.hidden}xbf16=@{Path(d) / 'x.bin'}",
                f"--task_topology_max_group_count={threads}", f"--benchmark_min_time={repeats}x", *runtime_flags]
        run = subprocess.run(base + ["--device_profiling_mode=host-execution", f"--device_profiling_output={prof}"],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(f"  (iree-benchmark-module failed: {run.stderr.strip()[-400:]})")
            return
        plain = subprocess.run(base + ["--benchmark_repetitions=5"], capture_output=True, text=True, check=True).stdout
        out = subprocess.run([str(tools / "iree-profile"), "dispatch", "--format=jsonl", "--dispatch_events", str(prof)],
                             capture_output=True, text=True, check=True).stdout
    events = [rec for rec in map(json.loads, out.splitlines()) if rec.get("type") == "host_dispatch_event"]
    if not events:
        print("  (no dispatch events in the profile)")
        return
    # one call = one submission; the median one by its span
    calls: dict[int, list[dict]] = {}
    for rec in events:
        calls.setdefault(rec["submission_id"], []).append(rec)
    spans = sorted((max(r["end_host_time_ns"] for r in c) - min(r["start_host_time_ns"] for r in c), sid)
                   for sid, c in calls.items())
    call = sorted(calls[spans[len(spans) // 2][1]], key=lambda r: r["start_host_time_ns"])
    t0 = call[0]["start_host_time_ns"]
    busy = 0
    print(f"timeline at {T} tokens, {threads} threads: the median of {len(calls)} calls by span ({len(call)} "
          f"dispatches, {spans[len(spans) // 2][0] / 1e3:.0f} us from the first dispatch's start to the last's end)")
    print(f"  {'start us':>9} {'took us':>8}  {'what':16s}  dispatch")
    for r in call:
        dur = r["duration_ns"] / 1e3
        busy += dur
        print(f"  {(r['start_host_time_ns'] - t0) / 1e3:9.1f} {dur:8.1f}  {_kind(r['key'])}  {r['key']} "
              f"(workgroups {'x'.join(map(str, r['workgroup_count']))})")
    per: dict[str, list[float]] = {}
    for c in calls.values():
        for r in c:
            per.setdefault(r["key"], []).append(r["duration_ns"] / 1e3)
    print("  per dispatch over all calls, us: median [min-max]")
    for key, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1]))[:6]:
        print(f"    {statistics.median(v):8.1f} [{min(v):.1f}-{max(v):.1f}]  {_kind(key)}  {key}")
    med = re.search(r"BM_\S+/process_time/real_time_median\s+([\d.]+) (ms|us)", plain)
    if med:
        v = float(med.group(1)) * (1 if med.group(2) == "ms" else 1e-3)
        print(f"  iree-benchmark-module, whole call (no profiling): {v:.3f} ms median of 5; the dispatches add up "
              f"to {busy / 1e3:.3f} ms")
    x = inputs(cfg, T)
    py = timed(lambda: cm(x), 21)
    print(f"  from Python (cm(x): torch in, torch out): {py * 1e3:.3f} ms median of 21")


def cold_rows(cm, cfg, xs, experts, per_expert: int, bw, copies: int, rounds: int, repeats: int) -> None:
    """mxmoe's calls with the weights coming from DRAM, as in a model where every layer reads its own: the module
    bound to ``copies`` copies of its weights at other addresses (each per-expert array rolled by one more expert,
    the router's rows too, so routing picks the rolled experts and the output is the same), called in turn, against
    the same calls on one copy (whose experts' weights stay in a large last-level cache from call to call). The
    peer's moe_bench has no such mode: its times are the warm ones."""
    E = cfg.num_experts
    params = cm.parameters
    bound = [cm] + [cm.with_parameters({k: np.roll(v, s, 0) if v.shape and v.shape[0] == E else v
                                        for k, v in params.items()}) for s in range(1, copies)]
    T0 = min(xs)
    ref = cm(xs[T0])
    # every copy is called once before timing: that binds its executor (made on a module's first call) and checks it
    if not all(torch.equal(b(xs[T0]), ref) for b in bound[1:]):
        sys.exit("--cold: a rolled copy gave another output (a per-expert parameter not rolled?)")
    print(f"\nweights from DRAM (--cold {copies}: {copies} copies of the weights, called in turn; mxmoe only), medians "
          f"over {rounds} rounds:")
    print(f"{'T':>5} {'MB':>6} | {'one copy ms':>11} | {'copies ms':>9} | {'x bound':>7}")
    for T, x in xs.items():
        warm, cold = [], []
        calls = iter(range(1 << 62))
        for _ in range(rounds):
            warm.append(timed(lambda: cm(x), repeats))
            cold.append(timed(lambda: bound[next(calls) % copies](x), max(repeats, 2 * copies)))
        mb = experts[T] * per_expert / 1e6
        c = statistics.median(cold) * 1e3
        print(f"{T:>5} {mb:6.1f} | {statistics.median(warm) * 1e3:11.2f} | {c:9.2f} | "
              f"{c / (mb / bw) if bw else float('nan'):7.2f}", flush=True)


def _kind(name: str) -> str:
    """What a dispatch of the cpu module is, from its name (mxmoe's C executables end in _group, _quantize
    and _ukernel; IREE names its own after the op: the router is the only matmul, the routing reductions)."""
    if name.startswith("mxmoe_grouped_matmul"):
        which = "w13" if "_glu_" in name else "w2" if "_combine_" in name else "matmul"
        step = {"_group": "grouping", "_quantize": "activations", "_ukernel": "GEMM"}.get(name[name.rindex("_"):], "")
        return f"{which + ' ' + step:16s}"
    for key, what in (("matmul", "router"), ("reduction", "route top-k"), ("slow_memcpy", "route copies"),
                      ("elementwise_Dx32", "route"), ("elementwise", "GLU / combine")):
        if key in name:
            return f"{what:16s}"
    return f"{'other':16s}"


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,4,8,64,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="alternations of mxmoe and the peer")
    p.add_argument("--repeats", type=int, default=9, help="timed calls per token count and round")
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--peer", default="auto", choices=["auto", "llamacpp", "none"])
    p.add_argument("--peer-bin", default=str(PEER_BIN))
    p.add_argument("--scaling", default="", help="token counts of the scaling row (e.g. 512,4096,32768,262144)")
    p.add_argument("--scaling-config", default="32,4,512,512", help="E,k,H,I of the scaling row's layer")
    p.add_argument("--timeline", default="", help="token counts to print a per-dispatch timeline for")
    p.add_argument("--cold", type=int, default=0, metavar="N",
                   help="also time mxmoe with its weights from DRAM: N copies of them called in turn (enough that "
                        "their bytes at the smallest T exceed the last-level cache)")
    p.add_argument("--torch", action="store_true", help="also time the eager torch baseline")
    p.add_argument("--no-peaks", action="store_true")
    p.add_argument("--activations", default="bf16", choices=["bf16", "mxint8", "mxint16"],
                   help="the activation form of the mxmoe module (compile option activations=)")
    p.add_argument("--runtime-flag", action="append", default=[], metavar="FLAG",
                   help="an IREE runtime flag for the mxmoe module (repeatable), e.g. --runtime-flag=--task_worker_spin_us=50")
    args = p.parse_args()
    set_threads(args.threads, args.runtime_flag)

    import mxmoe
    from mxmoe.core.config import MoEConfig, PRESETS
    from mxmoe.core.host import cpu_features
    from mxmoe.kernels.cpu import BF16_FLAVORS, matvec_object
    from mxmoe.torch_frontend.moe import MoE

    print(f"load avg before: {loadavg()}")
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True, text=True).stdout
    uk = matvec_object()
    print(f"cpu: {cpu.split(':', 1)[-1].strip()} x {os.cpu_count()}; features {' '.join(cpu_features() or [])}")
    print(f"mxmoe microkernel: {uk.flavor or 'none (' + uk.reason + ')'}; threads {args.threads}")
    peaks = {} if args.no_peaks else machine_peaks(args.threads)
    if peaks:
        print("machine peaks (benchmarks/cpu_peak.c), G op/s at 1 / %d threads:" % args.threads)
        for name in dict.fromkeys(n for n, _ in peaks if n != "read_bw"):
            print(f"  {name:18s} {peaks[(name, 1)]:7.1f} / {peaks.get((name, args.threads), float('nan')):7.1f}")
        print(f"  read bandwidth     {peaks[('read_bw', 1)]:7.1f} / {peaks.get(('read_bw', args.threads), float('nan')):7.1f} GB/s")
    avx512_instr = "vdpbf16ps-zmm" if args.activations == "bf16" else "vpdpbusd-zmm"
    gemm_instr = avx512_instr if uk.flavor in BF16_FLAVORS else "vpmaddwd-ymm"
    if uk.flavor == "avx512amx" and args.activations == "bf16":  # the GEMM of 5+ rows per item runs on AMX tiles
        gemm_instr = "amx-bf16"
    planes = 2 if args.activations == "mxint16" else 1  # int8 multiply-adds per useful one
    print(f"activations: {args.activations}; % peak of {gemm_instr}" + (f" / {planes}" if planes > 1 else ""))
    peak = instruction_peak(peaks, gemm_instr, args.threads)
    peak = peak / planes if peak else peak
    bw = peaks.get(("read_bw", args.threads))

    cfg = PRESETS[args.preset]
    moe = MoE.random(cfg, seed=0)
    t0 = time.perf_counter()
    cm = mxmoe.compile(moe, target="cpu", activations=args.activations)
    print(f"compile: {time.perf_counter() - t0:.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in cm.timings.items())})")
    per_expert = sum(getattr(moe, n)[0].numel() * getattr(moe, n).element_size()
                     for n in ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias") if getattr(moe, n) is not None)

    tokens = [int(t) for t in args.tokens.split(",") if t]
    xs = {T: inputs(cfg, T) for T in tokens}
    experts = {T: distinct_experts(moe, xs[T]) for T in tokens}
    peer = None
    if args.peer in ("auto", "llamacpp") and Path(args.peer_bin).is_file() and args.preset == "gpt-oss-20b":
        peer = Path(args.peer_bin)
    elif args.peer == "llamacpp":
        sys.exit(f"--peer llamacpp: {args.peer_bin} is not built (bash ../shared/peers/llamacpp/build.sh build/peers/llamacpp)")
    baseline = {d: TorchBaseline(moe, d) for d in (torch.bfloat16, torch.float32)} if args.torch else {}

    mx: dict[int, list[float]] = {T: [] for T in tokens}
    pe: dict[int, list[float]] = {T: [] for T in tokens}
    tb: dict[int, list[float]] = {T: [] for T in tokens}
    mx_best: dict[int, float] = {}  # the fastest single call of all rounds: the least disturbed one
    pe_best: dict[int, float] = {}
    # warm-up: every T for about a second (the first round's calls measured up to 2x slower than later rounds')
    for T in tokens:
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:
            cm(xs[T])
    for r in range(args.rounds):
        for T in tokens:
            ts = timings(lambda: cm(xs[T]), args.repeats if T < 512 else max(3, args.repeats // 2))
            mx[T].append(statistics.median(ts) * 1e3)
            mx_best[T] = min(mx_best.get(T, float("inf")), min(ts) * 1e3)
        if peer is not None:
            for T, (v, best) in run_peer(peer, tokens, experts, args.threads, args.repeats).items():
                pe[T].append(v)
                pe_best[T] = min(pe_best.get(T, float("inf")), best)
        for T in tokens:
            if baseline:
                tb[T].append(min(timed(lambda: b(xs[T]), 3, 1) for b in baseline.values()) * 1e3)
        print(f"round {r + 1}/{args.rounds} done (load avg {loadavg()})", flush=True)

    print(f"\n{args.preset} layer (E={cfg.num_experts} k={cfg.top_k} H={cfg.hidden} I={cfg.intermediate}), {args.threads} "
          f"threads, medians over {args.rounds} rounds of {args.repeats} calls each [min-max of the round medians]")
    head = (f"{'T':>5} {'experts':>7} {'MB':>6} | {'llama.cpp ms':>20} | {'mxmoe ms':>20} | {'ratio':>5} | "
            f"{'bound ms':>8} {'x bound':>7} | {'GFLOP/s':>7} {'% peak':>6}" + (f" | {'torch ms':>9}" if baseline else "")
            + " | rel err" + (" | exact err" if args.activations != "bf16" else ""))
    print(head)
    weights_np = moe.to_weights() if args.activations != "bf16" else None
    for T in tokens:
        mb = experts[T] * per_expert / 1e6
        m = statistics.median(mx[T])
        x = xs[T]
        out, ref_bf16 = cm(x).float(), moe(x).float()
        err = float((out - ref_bf16).abs().max() / ref_bf16.abs().max())
        exact = ""
        if weights_np is not None:
            from mxmoe.core.reference import numpy_reference, relative_error
            import ml_dtypes

            ref = numpy_reference(weights_np, x.float().numpy(), np.dtype(ml_dtypes.bfloat16),
                                  activations=args.activations)
            exact = f" | {relative_error(out.numpy(), ref):.1e}"
        if pe[T]:
            ratio = statistics.median(a / b for a, b in zip(pe[T], mx[T]))
            peer_s = f"{statistics.median(pe[T]):8.2f} [{spread(pe[T]):>10}]"
            ratio_s = f"{ratio:5.2f}"
        else:
            peer_s, ratio_s = f"{'-':>20}", f"{'-':>5}"
        bound = mb / 1e3 / bw * 1e3 if bw else float("nan")
        gf = expert_flops(cfg, T) / (m / 1e3) / 1e9
        print(f"{T:>5} {experts[T]:>7} {mb:6.1f} | {peer_s} | {m:8.2f} [{spread(mx[T]):>10}] | {ratio_s} | "
              f"{bound:8.2f} {m / bound:7.2f} | {gf:7.1f} {100 * gf / peak if peak else float('nan'):6.1f}"
              + (f" | {statistics.median(tb[T]):9.1f}" if baseline else "") + f" | {err:.1e}" + exact)
    print("the fastest single call of all rounds (the least disturbed by the machine's other jobs):")
    print(f"{'T':>5} | {'llama.cpp ms':>12} | {'mxmoe ms':>8} | {'ratio':>5} | {'x bound':>7} | {'GFLOP/s':>7} {'% peak':>6}")
    for T in tokens:
        b_mx = mx_best[T]
        bound = experts[T] * per_expert / 1e6 / bw if bw else float("nan")
        gf = expert_flops(cfg, T) / (b_mx / 1e3) / 1e9
        peer_b = pe_best.get(T)
        print(f"{T:>5} | {peer_b if peer_b else float('nan'):12.2f} | {b_mx:8.2f} | "
              f"{peer_b / b_mx if peer_b else float('nan'):5.2f} | {b_mx / bound:7.2f} | {gf:7.1f} "
              f"{100 * gf / peak if peak else float('nan'):6.1f}")

    if args.scaling:
        E, k, H, I = (int(v) for v in args.scaling_config.split(","))
        scfg = MoEConfig(num_experts=E, top_k=k, hidden=H, intermediate=I)
        smoe = MoE.random(scfg, seed=1)
        scm = mxmoe.compile(smoe, target="cpu", activations=args.activations)
        chunk = scm.bound().entry().token_chunk
        split = f"calls of more than {chunk} tokens run in pieces (MXMOE_CPU_TOKEN_CHUNK)" if chunk else "calls never split"
        print(f"\nscaling (E={E} k={k} H={H} I={I}): ms per call and us per token; {split}")
        row = []
        for T in (int(t) for t in args.scaling.split(",")):
            x = inputs(scfg, T)
            t = timed(lambda: scm(x), 3 if T >= 32768 else 5, 1)
            row.append(f"T={T}: {t * 1e3:.1f} ms, {t / T * 1e6:.2f} us/token")
            print("  " + row[-1], flush=True)
            del x

    if args.cold:
        cold_rows(cm, cfg, xs, experts, per_expert, bw, args.cold, args.rounds, args.repeats)

    for T in (int(t) for t in args.timeline.split(",") if t):
        print()
        timeline(cm, cfg, T, args.threads, 50 if T < 64 else 5, args.runtime_flag)
    print(f"\nload avg after: {loadavg()}")


if __name__ == "__main__":
    main()
