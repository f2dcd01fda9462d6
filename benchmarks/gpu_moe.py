"""GPU benchmark of the Triton path: gpt-oss-20b / -120b MoE layers on one NVIDIA GPU.

Two steps, because the GPU machines have no IREE (the compiler's MLIR bindings):

  # on a machine with the compiler (no GPU needed): kernel plans + sm_90 cubins, no weights
  python benchmarks/gpu_moe.py --build build/gpu_plans [--arch 90]
  # on the GPU machine (torch + triton; the repo importable as mxmoe, see benchmarks/_devpath.sh)
  python benchmarks/gpu_moe.py --plans build/gpu_plans [--models 'gpt-oss-20b;gpt-oss-120b;64,6,2048,1408'] \
      [--peer build/peers]     # triton_kernels (vLLM's Hopper MXFP4 MoE), timed in the same run
  # where one forward's time goes inside that graph (per launch: start, duration, gap; CUPTI)
  python benchmarks/gpu_moe.py --plans build/gpu_plans --timeline --tokens 1,8,64
  # the cost of the routing issue's options: build and time bundles compiled with one (docs/routing.md)
  python benchmarks/gpu_moe.py --build build/gpu_plans --numerics batch_invariant   # or nondeterministic
  python benchmarks/gpu_moe.py --plans build/gpu_plans --numerics batch_invariant
  # the w4a8 form (activations quantized to MXFP8; Hopper: fp8 wgmma): build and time its bundles
  python benchmarks/gpu_moe.py --build build/gpu_plans --activations mxfp8
  python benchmarks/gpu_moe.py --plans build/gpu_plans --activations mxfp8 --tokens 512,1024,4096,16384

Per row: mxmoe time (CUDA events, warm, median; the whole layer incl. router; for T <= 512 per forward
of a CUDA graph holding 10 forwards over 4 copies of the layer at different addresses, each on scratch it reserved
as a serving engine's does, and, as "1-call graph", of a graph holding one; above 512 tokens eager calls,
alternating with the peer's when it runs), the torch baseline in the same run (router + top-k with ties to the lower
expert index, as mxmoe routes, then the selected experts
dequantized to bf16 and run through ``torch._grouped_mm``, or a per-expert loop where that is
missing), bytes moved (selected experts' MXFP4 weights + scales + biases, router, activations in and
out, the [T*k, I] intermediate written and read) and % of the measured HBM bandwidth, FLOPs
(router + both expert GEMMs) and % of the measured dense bf16 peak. Routing: "uniform" (random
router) and "skewed" (router bias favouring a few experts: about half of all picks go to 1/8 of
the experts).

The families' presets (``--models 'mixtral-8x7b;qwen3-30b-a3b;qwen1.5-moe-a2.7b;olmoe-1b-7b;deepseek-v3;
llama-4-scout'``) run with their own routing, activation and shared expert: the torch baseline and the peer compute
gpt-oss's semantics only, so their columns are empty; "max err" is against the layer's own torch reference (T <= 64);
bytes and FLOPs include the shared expert; a layer without a router bias is timed with uniform routing only.
"max err" is the largest absolute difference over the tokens; where tokens whose logits nearly tie at the k-th expert
set it (two correct routers may route them differently, docs/routing.md), the largest over the other tokens follows
in brackets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

MODELS = ("gpt-oss-20b", "gpt-oss-120b")
TOKENS = (1, 8, 64, 512, 4096, 16384)


def model_config(name: str):
    """A preset name, or a layer shape ``E,k,H,I`` (gpt-oss semantics), or ``E,k,H,I,S``: with a gated MXFP4 shared
    expert of intermediate size S, as a MoEConfig."""
    from mxmoe.core.config import MoEConfig, preset

    if "," in name or name.startswith("shape-"):
        e, k, h, i, *s = (int(v) for v in name.removeprefix("shape-").replace("-", ",").split(","))
        shared = dict(shared_intermediate=s[0], shared_gate=True) if s else {}
        return MoEConfig(num_experts=e, top_k=k, hidden=h, intermediate=i, **shared)
    return preset(name)


#: the compile option the bundles are built with and timed under (--numerics): "" (the target's default:
#: deterministic), "nondeterministic" (deterministic=False: fp32 atomics) or "batch_invariant" (docs/routing.md);
#: a bundle built with one is named MODEL+OPTION
NUMERICS = ""
NUMERICS_OPTIONS = {"": {}, "nondeterministic": {"deterministic": False}, "batch_invariant": {"batch_invariant": True}}
#: the form the expert GEMMs take the activations in (--activations): "bf16" (default) or "mxfp8" (w4a8); a bundle
#: of the mxfp8 form is named MODEL+mxfp8 (after any numerics option); its error column is against the bf16 baseline
ACTIVATIONS = "bf16"


def bundle_name(name: str) -> str:
    """The plan bundle's folder for a model: the preset's name, or ``shape-E-k-H-I`` (+ the numerics option)."""
    base = "shape-" + name.replace(",", "-") if "," in name else name
    return base + (f"+{NUMERICS}" if NUMERICS else "") + (f"+{ACTIVATIONS}" if ACTIVATIONS != "bf16" else "")


# ------------------------------------------------------------------------------------------ build
def build(out_dir: str, arch: int, variants: list[tuple] = (), models=MODELS) -> None:
    import torch

    import mxmoe
    from mxmoe.kernels.triton.kernel_plan import write_bundle
    from mxmoe.torch_frontend import MoE

    for model in models:
        # Plans depend only on shapes and semantics: a small-seeded random layer of the right shape.
        name = bundle_name(model)
        layer = MoE.random(model_config(model), seed=0)
        cm = mxmoe.compile(layer, target=f"cuda:sm_{arch}", example_inputs=(torch.randn(4, layer.config.hidden).bfloat16(),),
                           activations=ACTIVATIONS, **NUMERICS_OPTIONS[NUMERICS])
        write_bundle(os.path.join(out_dir, name), cm.kernel_plan, cm.binaries)
        print(f"{name}: {len(cm.binaries)} cubins for sm_{arch} -> {out_dir}/{name}", flush=True)
        for label, variant in variants:  # AOT-compiled tile variants (one or more retiled GEMMs), to time what ships
            from mxmoe.kernels.triton.aot import compile_plan

            plan = cm.kernel_plan
            missing = {cls for cls, *_ in variant} - {c["name"] for c in plan["classes"]}
            if missing:
                print(f"{name}: no {', '.join(sorted(missing))} class, variant skipped", flush=True)
                continue
            for cls, gemm, *tiles in variant:
                plan = retile(plan, cls, gemm, *tiles)
            binaries, plan["cubins"] = compile_plan(plan)
            vname = name + "@" + (label or "+".join("-".join(map(str, v)) for v in variant))
            write_bundle(os.path.join(out_dir, vname), plan, binaries)
            print(f"{vname}: {len(binaries)} cubins", flush=True)


# ------------------------------------------------------------------------------------------- run
def params_from_layer(plan, layer):
    """The plan's parameters from an mxmoe MoE layer's buffers, values put into the plan's layout (gpt-oss
    dims need no padding; the executor checks every shape against the plan)."""
    from mxmoe.kernels.triton.kernel_plan import plan_parameters

    return plan_parameters(plan, {spec["operand"]: getattr(layer, spec["operand"]) for spec in plan["parameters"].values()})


def rolled_params(torch, params, num_experts, shift):
    """The same layer at other addresses: every per-expert tensor (router rows included) rolled by ``shift``
    experts, so routing picks the rolled experts and the output is unchanged."""
    return {g: torch.roll(t, shift, 0).contiguous() if t.shape[0] == num_experts else t for g, t in params.items()}


def measure_bandwidth(torch) -> float:
    """Device copy bandwidth (read + write bytes / s) over 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_cuda(torch, lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / t


def measure_bf16_peak(torch) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(torch, lambda: a @ b, iters=20)
    return 2 * 8192 ** 3 / t


def time_cuda(torch, fn, iters: int = 50, warmup: int = 5, graph: bool = False, reps: int = 1) -> float:
    """Median seconds per call (CUDA events around each call); ``graph`` replays a captured CUDA graph
    holding ``reps`` back-to-back calls (the time is per call), as a served model's graph holds many layers:
    one replay's own start-up (~14 us on the H100, measured with an empty graph) is then shared."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    call = capture_graph(torch, fn, reps).replay if graph else fn
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / (reps if graph else 1))
    return statistics.median(times)


def time_alternating(torch, fns, iters: int = 20, warmup: int = 3) -> list[float]:
    """Median seconds per call of each of ``fns``, called in turn (a, b, a, b, ...) with CUDA events around each
    call: a drift of the GPU's clocks or of the host during the measurement touches all of them alike (the eager
    rows, timed one after the other, moved 5-10% between runs and their ratios with them)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) / 1e3)
    return [statistics.median(ts) for ts in times]


def capture_graph(torch, fn, reps: int):
    """A CUDA graph of ``reps`` back-to-back calls of ``fn`` (warmed up on a side stream first, as capture
    needs), replayed three times so that its first replays are behind it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    return graph


def dequant_lut(torch, device):
    return torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                        dtype=torch.bfloat16, device=device)


BASELINE = {"gemm": "torch._grouped_mm"}
#: forwards per CUDA graph for the "mxmoe us" column (T <= GRAPH_MAX_TOKENS); "1-call graph us" replays one at a
#: time
GRAPH_REPS = 10
#: the largest token count timed in CUDA graphs (larger ones: eager calls); the executors reserve the scratch of
#: calls up to it, as a serving engine's graphs hold it (``mxmoe.engine``'s ``max_capture_size``): larger calls
#: allocate their own
GRAPH_MAX_TOKENS = 512


def torch_baseline(torch, F, layer, x, lut):
    """Router + top-k in torch, then only the selected experts dequantized to bf16 and a grouped GEMM."""
    from mxmoe.torch_frontend.ties import top_k

    cfg = layer.config
    logits = F.linear(x, layer.router_weight, layer.router_bias).float()
    top, ids = top_k(logits, cfg.top_k)  # ties to the lower expert index, as mxmoe routes (torch.topk's order is not)
    weights = torch.softmax(top, dim=-1)
    flat = ids.flatten()
    used, counts = torch.unique(flat, return_counts=True)
    order = torch.argsort(flat, stable=True)
    tokens = order // cfg.top_k

    def deq(w, s):  # [n, N, K/2] codes, [n, N, K/32] e8m0 -> [n, N, K] bf16
        codes = torch.stack([w & 0xF, w >> 4], -1).flatten(-2).long()
        scale = torch.exp2(s.float() - 127).to(torch.bfloat16).repeat_interleave(32, -1)
        return lut[codes] * scale

    w13 = deq(layer.w13[used], layer.w13_scale[used])  # [n, 2I, H]
    w2 = deq(layer.w2[used], layer.w2_scale[used])  # [n, H, I]
    xs = x[tokens]
    offs = torch.cumsum(counts, 0).to(torch.int32)

    def grouped(a, w):  # rows of a grouped by expert, w [n, N, K] -> [rows, N]
        if BASELINE["gemm"] == "torch._grouped_mm":
            try:
                return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
            except (RuntimeError, AttributeError, TypeError) as e:
                BASELINE["gemm"] = f"per-expert loop ({type(e).__name__} from _grouped_mm)"
        return torch.cat([p @ q.T for p, q in zip(a.split(counts.tolist()), w)])

    h = grouped(xs, w13)
    h = h.float() + layer.w13_bias[used].float().repeat_interleave(counts, 0)
    gate, up = h[:, 0::2].clamp(max=cfg.swiglu_limit), h[:, 1::2].clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
    a = ((up + 1) * gate * torch.sigmoid(cfg.swiglu_alpha * gate)).to(torch.bfloat16)
    y = grouped(a, w2)
    y = (y.float() + layer.w2_bias[used].float().repeat_interleave(counts, 0)) * weights.flatten()[order, None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tokens, y)
    return out.to(x.dtype)


def max_err(torch, F, layer, x, out, ref) -> str:
    """The largest |mxmoe - reference| over the tokens; where that is set by tokens whose router logits nearly tie at
    the k-th expert (two correct routers may pick different experts there: docs/routing.md), also the largest over
    the other tokens and how many near-tie tokens are above that, e.g. ``0.464 (0.0156 w/o 3 near-tie)``."""
    from mxmoe.torch_frontend.ties import near_tie_tokens

    diff = (out.float() - ref.float()).abs().reshape(x.shape[0], -1).amax(dim=1)
    near = near_tie_tokens(F.linear(x, layer.router_weight, layer.router_bias), layer.config.top_k)
    full = float(diff.max())
    rest = float(diff[~near].max()) if bool((~near).any()) else 0.0
    return f"{full:.3g}" if rest == full else f"{full:.3g} ({rest:.3g} w/o {int((diff > rest).sum())} near-tie)"


def is_gpt_oss_semantics(cfg) -> bool:
    """Whether a layer computes as gpt-oss's (what :func:`torch_baseline` and the peer implement)."""
    return (cfg.routing == "topk_softmax" and cfg.activation == "swiglu_oai" and cfg.interleaved and cfg.bias
            and not cfg.shared_intermediate and not cfg.apply_router_weight_on_input)


def sample_tokens(torch, T: int, H: int):
    """The benchmark's [T, H] bf16 hidden states on the GPU, drawn from a generator seeded with T: the same
    tokens (so the same experts) for a row whichever other rows a run asks for, in every mode."""
    return torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).cuda()


def skew_router(torch, layer, gen):
    """Add a bias favouring 1/8 of the experts strongly enough that ~half of all picks land there."""
    e = layer.config.num_experts
    bias = torch.zeros(e)
    hot = torch.randperm(e, generator=gen)[: max(1, e // 8)]
    bias[hot] = 1.5 * float(layer.router_weight.float().norm(dim=1).mean())  # ~ the logits std
    layer.router_bias.add_(bias.to(layer.router_bias))


def run(plans_dir: str, models: list[str], tokens: list[int], check: bool, baseline: bool = True,
        peer_dir: str | None = None) -> None:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the script's folder out
    from peer_triton_kernels import load as load_peer

    from mxmoe.runtime.triton_executor import TritonExecutor
    from mxmoe.kernels.triton.kernel_plan import read_bundle
    from mxmoe.torch_frontend import MoE

    dev = torch.cuda.get_device_name()
    bw = measure_bandwidth(torch)
    peak = measure_bf16_peak(torch)
    print(f"device: {dev}; measured copy bandwidth {bw / 1e12:.2f} TB/s; dense bf16 {peak / 1e12:.0f} TFLOP/s",
          flush=True)
    lut = dequant_lut(torch, "cuda")
    peer, why_not = load_peer(peer_dir)
    print(f"peer: {'triton_kernels from ' + peer_dir if peer else 'none (' + why_not + ')'}", flush=True)
    header = (f"| model | routing | T | mode | mxmoe us | 1-call graph us | torch us | speedup | GB moved | % HBM | "
              f"TFLOP | % bf16 peak | max err | peer us | mxmoe vs peer | peer % HBM | peer % peak |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    cached = {}  # model -> (layer, its weights in the plan layout, layout): retiled bundles of a model share them
    for name in models:
        plan, binaries = read_bundle(os.path.join(plans_dir, bundle_name(name)))
        model = name.split("@")[0]  # "MODEL@variant": a retiled plan of MODEL
        if model not in cached or cached[model][2] != plan["layer"]["layout"]:
            cached.clear()
            torch.cuda.empty_cache()
            layer = MoE.random(model_config(model), seed=0).cuda()
            cached[model] = (layer, params_from_layer(plan, layer), plan["layer"]["layout"])  # slow: once per model
        layer, params, _ = cached[model]
        cfg = layer.config
        gpt_oss_semantics = is_gpt_oss_semantics(cfg)  # the torch baseline computes those alone
        # skewed routing adds a bias to the router's: a layer without one is timed uniform only
        uniform_bias = layer.router_bias.clone() if layer.router_bias is not None else None
        for routing in ("uniform", "skewed") if uniform_bias is not None else ("uniform",):
            gen = torch.Generator().manual_seed(1)
            if uniform_bias is not None:
                layer.router_bias.copy_(uniform_bias)
            if routing == "skewed":
                skew_router(torch, layer, gen)  # params holds the layer's own router bias tensor
            ex = TritonExecutor(plan, params, binaries)
            copies = [TritonExecutor(plan, rolled_params(torch, params, layer.config.num_experts, shift), binaries)
                      for shift in (1, 2, 3)]
            for e in [ex] + copies:  # the graph rows' scratch kept from call to call, as mxmoe.engine keeps it
                e.reserve(GRAPH_MAX_TOKENS)
            E, k, H, I, S = cfg.num_experts, cfg.top_k, cfg.hidden, cfg.intermediate, cfg.shared_intermediate
            peer_cannot = (why_not or "not loaded") if peer is None else peer.unsupported(cfg)
            peer_layers = [peer.layer(layer) for _ in range(4)] if peer_cannot is None else []
            for T in tokens:
                x = sample_tokens(torch, T, H)
                with torch.no_grad():
                    used = int(torch.unique(layer.route_tokens(x)[1]).numel())  # its own routing
                    out = ex(x)
                    if gpt_oss_semantics:
                        ref = torch_baseline(torch, F, layer, x, lut) if check or baseline else None
                    else:  # the layer's own reference (its routing, activation and shared expert), small T only
                        ref = layer(x) if check and T <= 64 else None
                    err = max_err(torch, F, layer, x, out, ref) if check and ref is not None else "nan"
                # the 10-forward graph cycles through copies of the layer at other addresses so that no
                # forward finds its weights in L2 from the one before (as in a model, layer after layer)
                graph = T <= GRAPH_MAX_TOKENS
                exs = [ex] + copies if graph else [ex]
                calls = iter(range(1 << 62))
                if not graph and peer_layers:  # eager rows: mxmoe and the peer called in turn
                    t_mx, t_peer = time_alternating(torch, [lambda: ex(x), lambda: peer.forward(peer_layers[0], x)],
                                                    iters=50 if T <= 4096 else 20)
                else:
                    t_mx = time_cuda(torch, lambda: exs[next(calls) % len(exs)](x), graph=graph,
                                     iters=50 if T <= 4096 else 20, reps=GRAPH_REPS)
                t_one = time_cuda(torch, lambda: ex(x), graph=True, iters=50) if graph else t_mx
                t_th = (time_cuda(torch, lambda: torch_baseline(torch, F, layer, x, lut), iters=20 if T <= 4096 else 10)
                        if baseline and gpt_oss_semantics else float("nan"))
                bias_bytes = (2 * I + H) * 2 if cfg.bias else 0
                expert_bytes = used * (2 * I * H // 2 + 2 * I * H // 32 + H * I // 2 + H * I // 32 + bias_bytes)
                shared_bytes = (3 * S * H * 2 if cfg.shared_format == "bf16" else 3 * S * H // 2 + 3 * S * H // 32) + (
                    H * 2 if cfg.shared_gate else 0)
                moved = expert_bytes + shared_bytes + E * H * 2 + 2 * T * H * 2 + 2 * T * k * I * 2
                flops = 2 * T * k * (2 * I * H + H * I) + 2 * T * 3 * S * H + 2 * T * E * H
                if peer_layers:  # the same timing: graphs cycling through 4 copies (eager rows: above)
                    if graph:
                        pcalls = iter(range(1 << 62))
                        t_peer = time_cuda(torch, lambda: peer.forward(peer_layers[next(pcalls) % len(peer_layers)], x),
                                           graph=True, iters=50, reps=GRAPH_REPS)
                    peer_cols = (f"{t_peer * 1e6:.1f} | {t_peer / t_mx:.2f}x | {100 * moved / t_peer / bw:.0f}% | "
                                 f"{100 * flops / t_peer / peak:.1f}%")
                else:
                    peer_cols = f"n/a: {peer_cannot} | | |"
                print(f"| {name} | {routing} | {T} | {ex.mode}{'+graph' if graph else ''} | {t_mx * 1e6:.1f} | "
                      f"{t_one * 1e6:.1f} | {t_th * 1e6:.1f} | {t_th / t_mx:.2f}x | {moved / 1e9:.3f} | {100 * moved / t_mx / bw:.0f}% | "
                      f"{flops / 1e12:.3f} | {100 * flops / t_mx / peak:.1f}% | {err} | {peer_cols} |", flush=True)
            del ex, copies, peer_layers
        if uniform_bias is not None:
            layer.router_bias.copy_(uniform_bias)
    print(f"torch baseline GEMM: {BASELINE['gemm']}")


def breakdown(plans_dir: str, models: list[str], tokens: list[int], mode: str = "auto") -> None:
    """Median time of each launch of the plan (each replayed alone from a CUDA graph), per model and T."""
    import torch

    from mxmoe.runtime.triton_executor import TritonExecutor
    from mxmoe.kernels.triton.kernel_plan import read_bundle
    from mxmoe.torch_frontend import MoE

    for name in models:
        plan, binaries = read_bundle(os.path.join(plans_dir, bundle_name(name)))
        layer = MoE.random(model_config(name.split("@")[0]), seed=0).cuda()
        ex = TritonExecutor(plan, params_from_layer(plan, layer), binaries, mode=mode)
        for T in tokens:
            x = sample_tokens(torch, T, layer.config.hidden)
            print(f"{name} T={T} [{ex.mode}] " + launch_times(torch, ex, x), flush=True)
        del ex, layer
        torch.cuda.empty_cache()


def timeline(plans_dir: str, models: list[str], tokens: list[int]) -> None:
    """Where a forward's time goes inside the table's CUDA graph (10 forwards over 4 rolled copies of the
    layer): each launch's start (from the forward's first), duration and the idle gap before it, medians over
    the middle forwards of three replays, from CUPTI kernel records (``torch.profiler``). Unlike
    ``--breakdown`` nothing is timed alone, so no replay start-up is included."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mxmoe.runtime.triton_executor import TritonExecutor
    from mxmoe.kernels.triton.kernel_plan import read_bundle
    from mxmoe.torch_frontend import MoE

    for name in models:
        plan, binaries = read_bundle(os.path.join(plans_dir, bundle_name(name)))
        layer = MoE.random(model_config(name.split("@")[0]), seed=0).cuda()
        params = params_from_layer(plan, layer)
        exs = [TritonExecutor(plan, params, binaries)] + [
            TritonExecutor(plan, rolled_params(torch, params, layer.config.num_experts, shift), binaries)
            for shift in (1, 2, 3)]
        for e in exs:
            e.reserve(GRAPH_MAX_TOKENS)
        for T in tokens:
            x = sample_tokens(torch, T, layer.config.hidden)
            for ex in exs:  # first calls allocate (e.g. the executors' dummy arguments): not inside the capture
                ex(x)
            calls = iter(range(1 << 62))
            graph = capture_graph(torch, lambda: exs[next(calls) % len(exs)](x), GRAPH_REPS)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    graph.replay()
                torch.cuda.synchronize()
            events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                            if e.device_type.name == "CUDA")
            forwards = 3 * GRAPH_REPS
            per = len(events) // forwards
            if per * forwards != len(events):
                print(f"{name} T={T}: {len(events)} kernel records do not split into {forwards} forwards", flush=True)
                continue
            rows: dict[int, list] = {}
            spans = []
            for f in range(1, forwards - 1):  # not the first or last: their neighbours are other replays
                fwd = events[f * per:(f + 1) * per]
                spans.append(events[(f + 1) * per][0] - fwd[0][0])
                for i, (start, end, kname) in enumerate(fwd):
                    before = fwd[i - 1][1] if i else events[f * per - 1][1]
                    rows.setdefault(i, []).append((kname, start - fwd[0][0], end - start, start - before))
            print(f"{name} T={T}: forward to forward {statistics.median(spans):.1f} us", flush=True)
            for i in range(per):
                kname = rows[i][0][0].split("(")[0][:48]
                start, dur, gap = (statistics.median(r[j] for r in rows[i]) for j in (1, 2, 3))
                print(f"  {kname:48s} start {start:7.1f}  duration {dur:7.1f}  gap before {gap:5.1f} us", flush=True)
        del exs, layer
        torch.cuda.empty_cache()


def launch_times(torch, ex, x) -> str:
    buffers = {n: b.zero_() for n, b in ex.new_buffers(x.shape[0]).items()}
    parts, total = [], 0.0
    for step in ex.steps(x.shape[0]):
        t = time_cuda(torch, lambda: ex.launch(step, x, buffers), iters=30, graph=True)
        total += t
        parts.append(f"{step.entry}={t * 1e6:.1f}")
    return f"sum={total * 1e6:.1f}us " + " ".join(parts)


def retile(plan, cls_name: str, gemm: str, block_n: int, block_k: int, warps: int, stages: int,
           tma: int | None = None, tail: int | None = None):
    """A copy of ``plan`` whose class ``cls_name`` runs GEMM ``gemm`` ("glu_gemm"/"combine_gemm") with
    other tiles (BLOCK_M unchanged; ``tma`` 0/1 switches TMA weight tiles; ``tail`` sets TAIL_M, 0 = none), for
    sweeps."""
    import copy

    plan = copy.deepcopy(plan)
    cls = next(c for c in plan["classes"] if c["name"] == cls_name)
    launch = next(lc for lc in cls["launches"] if plan["kernels"][lc["kernel"]]["kernel"] == gemm)
    entry = copy.deepcopy(plan["kernels"][launch["kernel"]])
    entry["constexprs"].update(BLOCK_N=block_n, BLOCK_K=block_k)
    if tma is not None:
        entry["constexprs"]["W_TMA"] = bool(tma)
    if tail:
        entry["constexprs"]["TAIL_M"] = tail
    elif tail is not None:
        entry["constexprs"].pop("TAIL_M", None)
    entry["num_warps"], entry["num_stages"] = warps, stages
    new = f"{gemm}.{cls_name}.sweep"
    plan["kernels"][new] = entry
    n = 2 * plan["layer"]["intermediate"] if gemm == "glu_gemm" else plan["layer"]["hidden"]
    launch["kernel"], launch["grid"] = new, [launch["grid"][0], f"cdiv({n}, {block_n})", *launch["grid"][2:]]
    plan.pop("cubins", None)
    return plan


def sweep(plans_dir: str, name: str, tokens: list[int], candidates: list[tuple]) -> None:
    """JIT-time GEMM tile candidates (gemm, BLOCK_N, BLOCK_K, warps, stages) at each T."""
    import torch

    from mxmoe.runtime.triton_executor import TritonExecutor
    from mxmoe.kernels.triton.kernel_plan import KernelPlan, read_bundle
    from mxmoe.torch_frontend import MoE

    plan, _ = read_bundle(os.path.join(plans_dir, bundle_name(name)))
    layer = MoE.random(model_config(name), seed=0).cuda()
    params = params_from_layer(plan, layer)
    for T in tokens:
        x = sample_tokens(torch, T, layer.config.hidden)
        cls = KernelPlan.from_dict(plan).shape_class(T).name
        base = TritonExecutor(plan, params, mode="jit")
        ref = base(x).float()
        for gemm, bn, bk, w, st in candidates:
            try:
                ex = TritonExecutor(retile(plan, cls, gemm, bn, bk, w, st), params, mode="jit")
                err = float((ex(x).float() - ref).abs().max())
                buffers = {n: b.zero_() for n, b in ex.new_buffers(T).items()}
                step = next(st_ for st_ in ex.steps(T) if st_.entry == f"{gemm}.{cls}.sweep")
                t = time_cuda(torch, lambda: ex.launch(step, x, buffers), iters=30, graph=True)
                print(f"sweep {name} T={T} {gemm} N={bn} K={bk} w={w} s={st}: {t * 1e6:.1f} us (err {err:.3g})",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a sweep reports and moves on
                print(f"sweep {name} T={T} {gemm} N={bn} K={bk} w={w} s={st}: FAILED {str(e).splitlines()[0][:120]}",
                      flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", metavar="DIR", help="compile plans + cubins into DIR (CPU machine with the compiler)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--variants", default="", help="with --build: extra AOT bundles with other GEMM tiles, "
                    "'[label=]class:gemm:N:K:warps:stages[:tma[:tail_m]][+class:gemm:...];...' (named MODEL@label "
                    "or MODEL@class-gemm-N-K-warps-stages[-tma[-tail_m]][+...]; "
                    "'+' retiles several GEMMs in one bundle)")
    ap.add_argument("--plans", metavar="DIR", default="build/gpu_plans", help="plans built by --build")
    ap.add_argument("--models", default=";".join(MODELS),
                    help="';'-separated presets or layer shapes E,k,H,I (gpt-oss semantics) or E,k,H,I,S (with a "
                         "gated MXFP4 shared expert of intermediate S), e.g. 'gpt-oss-20b;64,6,2048,1408'")
    ap.add_argument("--peer", metavar="DIR", help="folder holding triton_kernels/ (the Hopper peer, timed in the same "
                                                   "run: bash ../shared/peers/get_triton_kernels.sh DIR)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--numerics", choices=list(NUMERICS_OPTIONS), default="",
                    help="build / time the bundles compiled with this option (docs/routing.md)")
    ap.add_argument("--activations", choices=["bf16", "mxfp8"], default="bf16",
                    help="build / time the bundles of this activation form (mxfp8: w4a8, docs/nvidia.md)")
    ap.add_argument("--no-check", action="store_true", help="skip the mxmoe-vs-baseline max error column")
    ap.add_argument("--no-baseline", action="store_true", help="skip timing the torch baseline (tile sweeps)")
    ap.add_argument("--breakdown", action="store_true", help="time each kernel launch instead of the table")
    ap.add_argument("--timeline", action="store_true",
                    help="per-launch start / duration / gap inside the table's CUDA graph (CUPTI) instead of the table")
    ap.add_argument("--mode", default="auto", help="executor mode for --breakdown (auto, cubin, jit)")
    ap.add_argument("--sweep", metavar="SPEC", help="JIT sweep of GEMM tiles: 'gemm:N:K:warps:stages;...'")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(";") if m]
    global NUMERICS, ACTIVATIONS
    NUMERICS, ACTIVATIONS = args.numerics, args.activations
    if args.build:
        variants = []
        for v in filter(None, args.variants.split(";")):
            label, _, v = v.rpartition("=")
            variants.append((label, [(c[0], c[1], *map(int, c[2:])) for c in (g.split(":") for g in v.split("+"))]))
        build(args.build, args.arch, variants, models)
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.breakdown:
        breakdown(args.plans, models, tokens, args.mode)
        return 0
    if args.timeline:
        timeline(args.plans, models, tokens)
        return 0
    if args.sweep:
        cands = [(c[0], *map(int, c[1:])) for c in (c.split(":") for c in args.sweep.split(";") if c)]
        for name in models:
            sweep(args.plans, name, tokens, cands)
        return 0
    run(args.plans, models, tokens, not args.no_check, not args.no_baseline, args.peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
