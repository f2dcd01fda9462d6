"""Sharded MoE layers over torch.distributed with gloo, 2 and 4 ranks spawned by the test: each mode (ep, tp,
ep+tp; allgather and all-to-all exchanges) against the single-process layer on the same weights and tokens,
including ranks with no tokens, all tokens on one rank's experts and uneven token counts; deterministic output;
clear errors when ranks disagree or one dies."""

from __future__ import annotations

import itertools
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mxmoe.core.config import MoEConfig
from mxmoe.torch_frontend import MoE

TOL = 2e-2
_RUNS = itertools.count()


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=8, top_k=2, hidden=64, intermediate=128, activation="silu", interleaved=False)
    base.update(kw)
    return MoEConfig(**base)


def _tokens(counts, h=64, seed=0, dtype="bfloat16"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, generator=g).to(getattr(torch, dtype)) for n in counts]


def _worker(rank, world, init, case, results):
    """One rank: shard the layer (or, with ``part``, load its part of that sharded artifact), run its tokens, put
    (output, error) in ``results``; with ``nccl``, on GPU ``rank`` over NCCL."""
    try:
        gpu = case.get("nccl", False)
        if gpu:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if gpu else "gloo", init_method=init, rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=case.get("timeout", 60)),
                                **({"device_id": torch.device("cuda", rank)} if gpu else {}))
        from mxmoe.distributed import load, shard

        if case.get("part"):
            sharded = load(case["part"], dispatch=case.get("dispatch", "auto"))
        else:
            layer = _layer(case, rank if case.get("disagree") else 0)
            sharded = shard(layer.cuda() if gpu else layer, case["mode"], dispatch=case.get("dispatch", "auto"))
        if case.get("compile"):
            sharded.compile(case["compile"])
        xs = _tokens(case["counts"], seed=case.get("seed", 0), dtype=case.get("dtype", "bfloat16"))
        x = xs[rank].cuda() if gpu else xs[rank]
        if case.get("die") is not None and rank == case["die"]:
            os._exit(3)  # a rank that dies before the collective
        outs = [sharded(x) for _ in range(case.get("repeat", 1))]
        stats = dict(sharded.stats)
        if case.get("artifact"):  # the same layer's parts from a sharded artifact, on the same tokens
            stats["artifact_out"] = load(case["artifact"])(x).float()
        results[rank] = ("ok", [o.float().cpu() for o in outs], stats)
        dist.destroy_process_group()
    except Exception as e:  # reported to the parent
        results[rank] = ("error", f"{type(e).__name__}: {e}", traceback.format_exc()[-2000:])


def _run(world, case, tmp_path, worker=None):
    ctx = mp.get_context("spawn")
    init = tmp_path / f"init{next(_RUNS)}"  # a fresh rendezvous file for each launch
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=worker or _worker, args=(r, world, f"file://{init}", case, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        return {r: results.get(r) for r in range(world)}, [p.exitcode for p in procs]


def _layer(case, seed_offset: int = 0) -> MoE:
    """The case's layer; ``hot`` experts get a router bias that makes every token pick them."""
    layer = MoE.random(_cfg(**case.get("cfg", {})), seed=case.get("layer_seed", 1) + seed_offset,
                       dtype=getattr(torch, case.get("dtype", "bfloat16")))
    with torch.no_grad():
        for e in case.get("hot", ()):
            layer.router_bias[e] += 100.0
    return layer


def _expect(case):
    layer = _layer(case)
    xs = _tokens(case["counts"], seed=case.get("seed", 0), dtype=case.get("dtype", "bfloat16"))
    return [layer(x).float() if len(x) else x.float() for x in xs]


def _check(world, case, tmp_path):
    results, codes = _run(world, case, tmp_path)
    want = _expect(case)
    for r in range(world):
        status, outs, info = results[r]
        assert status == "ok", f"rank {r}: {outs}\n{info}"
        for out in outs:
            assert out.shape == want[r].shape
            if want[r].numel():
                err = float((out - want[r]).abs().max() / want[r].abs().max())
                assert err < TOL, f"rank {r}: relative error {err}"
        if len(outs) > 1:
            assert all(torch.equal(outs[0], o) for o in outs[1:]), f"rank {r}: not deterministic"
    return results


@pytest.mark.parametrize("mode, dispatch", [("ep", "allgather"), ("ep", "all_to_all"), ("tp", "allgather")])
def test_two_ranks_match_the_layer(mode, dispatch, tmp_path):
    _check(2, {"mode": mode, "dispatch": dispatch, "counts": [5, 9], "repeat": 2}, tmp_path)


#: DeepSeek-V3's routing (fp32 router, sigmoid scores with a correction bias, group-limited, scaled) and its shared
#: expert in bf16: every rank must route its tokens as the whole layer does
_DEEPSEEK = {"routing": "sigmoid_topk", "renormalize": True, "n_group": 4, "topk_group": 2, "score_bias": True,
             "routed_scaling_factor": 2.5, "router_fp32": True, "router_bias": False, "bias": False, "top_k": 3,
             "shared_intermediate": 64, "shared_format": "bf16"}


def test_a_rank_with_no_tokens_and_uneven_counts(tmp_path):
    _check(2, {"mode": "ep", "dispatch": "all_to_all", "counts": [0, 13]}, tmp_path)
    _check(2, {"mode": "tp", "dispatch": "allgather", "counts": [17, 0], "cfg": _DEEPSEEK}, tmp_path)


def test_all_tokens_on_one_ranks_experts(tmp_path):
    """A router that sends every token to experts 0 and 1 (rank 0's under ep): with the all-to-all exchange rank 1's
    experts run no rows at all, rank 0's run every token."""
    case = {"mode": "ep", "dispatch": "all_to_all", "counts": [6, 5], "hot": (0, 1)}
    results = _check(2, case, tmp_path)
    assert results[0][2]["expert_rows"] == 11 and results[1][2]["expert_rows"] == 0


_SHARED = {"shared_intermediate": 64, "shared_gate": True, "bias": True}


def _rank_order_sums(case, ep: int, tp: int) -> list[torch.Tensor]:
    """What every rank must return, bit for bit: each rank's partial output for all tokens (as the ranks compute
    it: every rank's tokens in rank order), summed in fp32 in rank order, plus the shared expert, rounded once."""
    from mxmoe.distributed import ShardSpec, shard_weights

    layer = _layer(case)
    xs = _tokens(case["counts"], seed=case.get("seed", 0), dtype=case.get("dtype", "bfloat16"))
    routed = [layer.route_tokens(x) for x in xs]
    x_all = torch.cat(xs)
    w_all, ids_all = torch.cat([w for w, _ in routed]), torch.cat([i for _, i in routed]).to(torch.int32)
    parts = [MoE(shard_weights(layer.to_weights(), ShardSpec(ep, tp, q)), dtype=layer.dtype)
             for q in range(ep * tp)]
    partials = [p.modular(x_all, w_all, ids_all, shared=False).float() for p in parts]
    out, at = [], 0
    for x in xs:
        rows = slice(at, at + len(x))
        at += len(x)
        acc = partials[0][rows].clone()
        for p in partials[1:]:
            acc += p[rows]
        if layer.config.shared_intermediate and len(x):
            acc = acc + parts[0]._shared_expert(x).float()
        out.append(acc.to(layer.dtype).float())
    return out


def test_four_ranks_ep_tp_and_shared_experts(tmp_path, artifacts):
    """ep=2 x tp=2 with a gated shared expert, in fp32 (bf16 partials add exactly in fp32 in any order; fp32 ones do
    not): the partials are summed in rank order (bitwise the sum computed here in that order, which gloo's
    reduce-scatter does not give), and the ep:2,tp:2 artifact's parts (compiled, loaded by each rank) match the
    layer too."""
    case = {"mode": {"ep": 2, "tp": 2}, "counts": [3, 0, 8, 5], "repeat": 2, "cfg": _SHARED, "dtype": "float32",
            "artifact": str(artifacts["ep:2,tp:2"])}
    results = _check(4, case, tmp_path)
    want = _rank_order_sums(case, 2, 2)
    ref = _expect(case)
    for r in range(4):
        assert torch.equal(results[r][1][0], want[r]), f"rank {r}: not the fp32 sum in rank order"
        got = results[r][2]["artifact_out"]
        assert got.shape == ref[r].shape
        if ref[r].numel():
            assert float((got - ref[r]).abs().max() / ref[r].abs().max()) < TOL, f"rank {r}: artifact part"


# ============================================================================================ artifacts

@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Sharded artifacts of the test layers (each compiled once, deterministic): ep:2 and tp:2 of the plain layer,
    ep:2,tp:2 of the fp32 layer with a shared expert."""
    from mxmoe.shard_artifact import save_sharded

    d = tmp_path_factory.mktemp("sharded")
    out = {}
    for layout, case in (("ep:2", {}), ("tp:2", {}), ("ep:2,tp:2", {"cfg": _SHARED, "dtype": "float32"})):
        out[layout] = d / f"{layout.replace(':', '').replace(',', '_')}.mxmoe"
        save_sharded(_layer(case), out[layout], layout, "cpu", deterministic=True)
    return out


@pytest.fixture(scope="module")
def checkpoint_artifact(tmp_path_factory):
    """A gpt-oss checkpoint of two tiny layers (0 and 2) and ``mxmoe compile CKPT --shard ep:2`` of it: one
    artifact, sets layer.N.rank.R."""
    from mxmoe.cli import main
    from mxmoe.core.checkpoint import write_hf_gpt_oss
    from mxmoe.core.config import preset
    from mxmoe.core.weights import MoEWeights

    d = tmp_path_factory.mktemp("ckpt")
    write_hf_gpt_oss(d / "ckpt", {n: MoEWeights.random(preset("tiny"), seed=40 + n) for n in (0, 2)},
                     float_dtype="bfloat16")
    assert main(["compile", str(d / "ckpt"), "--target", "cpu", "--shard", "ep:2", "-o", str(d / "m.mxmoe"),
                 "-q"]) == 0
    return str(d / "ckpt"), str(d / "m.mxmoe")


_COUNTS = ([5, 9], [0, 13], [1, 0], [0, 0])  # uneven, a rank without tokens, one token in all, none at all


def _artifact_worker(rank, world, init, case, results):
    """One rank: load each artifact's part (and, for the first, shard + compile the layer in memory too) and run
    this rank's tokens of every count pattern twice."""
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=60))
        from mxmoe.distributed import load, shard

        outs = {}
        for name, path, dispatch in case["loads"]:
            part = load(path, dispatch=dispatch)
            for i, counts in enumerate(_COUNTS):
                x = _tokens(counts, seed=i)[rank]
                outs[(name, i)] = [part(x).float() for _ in range(2)]
        mem = shard(_layer({}), "ep").compile("cpu", deterministic=True)
        for i, counts in enumerate(_COUNTS):
            outs[("memory", i)] = [mem(_tokens(counts, seed=i)[rank]).float()]
        results[rank] = ("ok", outs, None)
        dist.destroy_process_group()
    except Exception as e:
        results[rank] = ("error", f"{type(e).__name__}: {e}", traceback.format_exc()[-2000:])


def test_artifact_parts_round_trip_and_repeat_bitwise(tmp_path, artifacts):
    """Each rank loads its part of the ep:2 (both exchanges) and tp:2 artifacts and runs uneven token counts, a rank
    with none, one token, none at all: the layer's output within tolerance; the ep part bitwise the in-memory
    compiled shard's; and a second launch of the whole thing gives the same bits (deterministic compile, fp32
    partials summed in rank order)."""
    case = {"loads": [("ep", str(artifacts["ep:2"]), "allgather"), ("ep-a2a", str(artifacts["ep:2"]), "all_to_all"),
                      ("tp", str(artifacts["tp:2"]), "auto")]}
    runs = [_run(2, case, tmp_path, _artifact_worker)[0] for _ in range(2)]
    layer = _layer({})
    for r in range(2):
        for run in runs:
            assert run[r][0] == "ok", f"rank {r}: {run[r][1]}\n{run[r][2]}"
        outs, again = runs[0][r][1], runs[1][r][1]
        for i, counts in enumerate(_COUNTS):
            x = _tokens(counts, seed=i)[r]
            want = layer(x).float() if len(x) else x.float()
            for name in ("ep", "ep-a2a", "tp"):
                first, second = outs[(name, i)]
                assert first.shape == want.shape == (counts[r], 64)
                if len(x):
                    err = float((first - want).abs().max() / want.abs().max())
                    assert err < TOL, f"rank {r}, {name}, counts {counts}: relative error {err}"
                assert torch.equal(first, second), f"rank {r}, {name}: two calls differ"
                assert torch.equal(first, again[(name, i)][0]), f"rank {r}, {name}, counts {counts}: launches differ"
            assert torch.equal(outs[("ep", i)][0], outs[("memory", i)][0]), f"rank {r}: artifact vs in-memory part"


def _bad_load_worker(rank, world, init, case, results):
    """One rank: each step names what this rank loads (a path, or "die"); record each error and its time."""
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=case["timeout"]))
        from mxmoe.distributed import load

        got = []
        for step in case["steps"]:
            what, kwargs = step[rank] if isinstance(step[rank], tuple) else (step[rank], {})
            if what == "die":
                os._exit(3)
            t0 = time.perf_counter()
            try:
                part = load(what, **kwargs)
                out = part(_tokens([3, 4], seed=7)[rank]).float() if "layer" in kwargs else None
                got.append(("loaded", out, time.perf_counter() - t0))
            except Exception as e:  # noqa: BLE001 - the test reads the type and message
                got.append((type(e).__name__, str(e), time.perf_counter() - t0))
            results[rank] = ("ok", list(got), None)
    except Exception as e:
        results[rank] = ("error", f"{type(e).__name__}: {e}", traceback.format_exc()[-2000:])


def test_a_rank_loading_another_layout_gets_a_clear_error(tmp_path, artifacts, checkpoint_artifact):
    """Rank 1 loads the tp:2 artifact while rank 0 loads ep:2; then both load the 4-rank artifact in a 2-rank
    group; then rank 1 names a missing file; then ranks pick different layers of a whole-checkpoint artifact;
    then rank 1 dies: every rank gets a DistributedError saying what, within the process group's timeout (5 s
    here). In between, good loads work (layer 2 of the checkpoint artifact: its output)."""
    ep, tp, four = (str(artifacts[k]) for k in ("ep:2", "tp:2", "ep:2,tp:2"))
    ckpt_dir, multi = checkpoint_artifact
    steps = [(ep, tp), (four, four), (ep, str(tmp_path / "missing.mxmoe")), (ep, ep),
             ((multi, {"layer": 2}),) * 2, ((multi, {"layer": 0}), (multi, {"layer": 2})), (ep, "die")]
    results, codes = _run(2, {"steps": steps, "timeout": 5}, tmp_path, _bad_load_worker)
    assert codes[1] == 3
    r0, r1 = results[0][1], results[1][1]
    assert results[0][0] == results[1][0] == "ok", (results[0], results[1])
    for got in (r0[0], r1[0]):
        assert got[0] == "DistributedError" and "different layouts or layers" in got[1], got
        assert "rank 0: ep=2, tp=1" in got[1] and "rank 1: ep=1, tp=2" in got[1], got
    for got in (r0[1], r1[1]):
        assert got[0] == "DistributedError" and "cut for 4 ranks (ep=2, tp=2), but the group has 2" in got[1], got
    for got in (r0[2], r1[2]):
        assert got[0] == "DistributedError" and "rank(s) [1] could not load" in got[1] and "no such file" in got[1]
    assert r0[3][0] == r1[3][0] == "loaded"
    layer2 = MoE.from_hf_checkpoint(ckpt_dir, 2)
    for r, got in enumerate((r0[4], r1[4])):
        assert got[0] == "loaded", got
        want = layer2(_tokens([3, 4], seed=7)[r]).float()
        assert float((got[1] - want).abs().max() / want.abs().max()) < TOL, f"rank {r}: layer 2"
    for got in (r0[5], r1[5]):
        assert got[0] == "DistributedError" and "(layer.0)" in got[1] and "(layer.2)" in got[1], got
    assert r0[6][0] == "DistributedError" and "could not agree" in r0[6][1], r0[6]
    assert r0[6][2] < 5 + 10, f"the dead rank took {r0[6][2]:.1f} s to notice"
    print(f"dead rank noticed after {r0[6][2]:.2f} s")


def _compile_worker(rank, world, init, case, results):
    """One rank: a model of two MoE layers between linears, sharded with its parts compiled by mxmoe, run eagerly
    and under torch.compile(backend="mxmoe"); and under fullgraph=True, which must say why it cannot."""
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=60))
        import warnings

        from mxmoe.distributed import shard_model

        model = _Net()
        assert shard_model(model, case["mode"], compile="cpu", deterministic=True) == 2
        out = {}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            compiled = torch.compile(model, backend="mxmoe", options={"rest": "eager", "cache_dir": None})
            for i, counts in enumerate(case["counts"]):
                x = _tokens(counts, seed=i)[rank]
                out[i] = (model(x).float(), compiled(x).float())
        out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen if "mxmoe" in str(w.category).lower()]
        try:
            torch.compile(_shard_copy(case["mode"]), backend="mxmoe", fullgraph=True)(_tokens([2, 2])[rank])
            out["fullgraph"] = "compiled"
        except Exception as e:  # noqa: BLE001
            out["fullgraph"] = f"{type(e).__name__}: {e}"
        results[rank] = ("ok", out, None)
        dist.destroy_process_group()
    except Exception as e:
        results[rank] = ("error", f"{type(e).__name__}: {e}", traceback.format_exc()[-2000:])


class _Net(torch.nn.Module):
    """Linear -> MoE (residual) -> Linear -> MoE (residual), bf16, the same weights on every rank."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.w_in = torch.nn.Parameter((torch.randn(64, 64, generator=g) / 8).bfloat16(), requires_grad=False)
        self.w_mid = torch.nn.Parameter((torch.randn(64, 64, generator=g) / 8).bfloat16(), requires_grad=False)
        self.moe1 = _layer({"layer_seed": 3})
        self.moe2 = _layer({"layer_seed": 4})

    def forward(self, x):
        h = torch.relu(x @ self.w_in)
        h = h + self.moe1(h)
        h = torch.tanh(h @ self.w_mid)
        return h + self.moe2(h)


def _shard_copy(mode):
    from mxmoe.distributed import shard_model

    model = _Net()
    shard_model(model, mode)
    return model


def test_torch_compile_of_a_model_with_sharded_layers(tmp_path):
    """torch.compile(backend="mxmoe") of a model whose MoE layers were sharded on every rank: the parts are graph
    breaks (collectives in eager PyTorch, experts mxmoe-compiled), the output is the eager sharded model's bit for
    bit and the single-process model's within tolerance, a rank with no tokens included; fullgraph=True is an
    error that says why."""
    case = {"mode": "ep", "counts": ([4, 7], [0, 5])}
    results, _ = _run(2, case, tmp_path, _compile_worker)
    plain = _Net()
    for r in range(2):
        assert results[r][0] == "ok", f"rank {r}: {results[r][1]}\n{results[r][2]}"
        out = results[r][1]
        for i, counts in enumerate(case["counts"]):
            eager, compiled = out[i]
            x = _tokens(counts, seed=i)[r]
            assert torch.equal(eager, compiled), f"rank {r}, counts {counts}"
            if len(x):
                want = plain(x).float()
                assert float((compiled - want).abs().max() / want.abs().max()) < TOL, f"rank {r}, counts {counts}"
            else:
                assert compiled.shape == (0, 64)
        assert not out["warnings"], out["warnings"]  # no region fell back
        assert "ShardedMoE runs outside the compiled graph" in out["fullgraph"], out["fullgraph"]


def test_compiled_shards(tmp_path):
    """mxmoe.compile on each rank's shard (the cpu target's default lowering skips other ranks' experts)."""
    _check(2, {"mode": "ep", "counts": [7, 4], "compile": "cpu"}, tmp_path)


def _parts_add_up(ep: int, tp: int, target: str, device: str, tokens=(1, 9, 70), shared: dict | None = None,
                  **options) -> None:
    """Each rank's part compiled for ``target``, run in one process on the same tokens: the parts' partial outputs
    add up to the whole layer's routed experts (what the collectives then sum or gather); with a ``shared`` expert
    (config fields), the part's "shared" entry (its own weights, apart from the routed entry's) is the layer's."""
    from mxmoe.distributed import ShardedMoE, ShardSpec

    cfg = _cfg(num_experts=12, top_k=3, hidden=128, intermediate=192, bias=True, router_bias=True, **(shared or {}))
    layer = MoE.random(cfg, seed=4).to(device)
    parts = [ShardedMoE(layer, ShardSpec(ep, tp, rank)).compile(target, **options) for rank in range(ep * tp)]
    for t in tokens:
        x = _tokens([t], h=128, seed=t)[0].to(device)
        with torch.no_grad():
            weights, ids = layer.route_tokens(x)
            want = layer.modular(x, weights, ids, shared=False).float()
            got = sum(part._experts(x, weights, ids).float() for part in parts)
            if shared:
                want_shared, got_shared = layer._shared_expert(x).float(), parts[-1]._shared(x).float()
                assert float((got_shared - want_shared).abs().max() / want_shared.abs().max()) < TOL, (ep, tp, t)
        assert float((got - want).abs().max() / want.abs().max()) < TOL, (ep, tp, t)


def test_triton_parts_add_up_to_the_layer_under_the_interpreter():
    """The cuda target's parts (the Triton path's modular entry with the expert map; a tp slice of the
    intermediate dim) on this CPU, kernels under Triton's interpreter; the H100 runs the next test."""
    pytest.importorskip("triton")
    _parts_add_up(2, 2, "cuda:sm_90", "cpu", tokens=(1, 9), interpret=True)


def test_a_triton_part_with_a_shared_expert_under_the_interpreter():
    """A part with DeepSeek's bf16 shared expert: two entries (modular_routed, shared) whose weights differ, bound
    together (the shared entry's weights are not the routed one's: it once found none)."""
    pytest.importorskip("triton")
    _parts_add_up(2, 1, "cuda:sm_90", "cpu", tokens=(5,), interpret=True,
                  shared={"shared_intermediate": 64, "shared_format": "bf16"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [(2, 1), (1, 2), (2, 2)])
def test_cuda_compiled_parts_add_up_to_the_layer(mode):
    """The same on the GPU. The collectives between ranks are not in this test (one GPU: no NCCL group)."""
    pytest.importorskip("iree.compiler", reason="the compiler's IREE bindings are not on this GPU machine")
    major, minor = torch.cuda.get_device_capability()
    _parts_add_up(*mode, f"cuda:sm_{major}{minor}", "cuda")


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs")
    if not dist.is_nccl_available():
        pytest.skip("torch has no NCCL")


#: the cuda sharded artifacts' cuts and their test cases (layout, dispatch, tokens per rank)
_CUDA_CUTS = [("ep:2", "allgather", [1, 70]), ("ep:2", "all_to_all", [9, 0]), ("tp:2", "auto", [4, 33]),
              ("ep:2,tp:2", "auto", [3, 0, 8, 5])]
#: the layer those artifacts hold (``_layer`` of this case)
_CUDA_CASE = {"cfg": {"bias": True}}


def _cuda_artifact_path(root: str, layout: str) -> str:
    return os.path.join(root, "distributed", f"{layout.replace(':', '').replace(',', '-')}.mxmoe")


def write_cuda_artifacts(root: str) -> None:
    """Write the GPU tests' sharded artifacts (cuda:sm_90) under ``root``/distributed, on a machine with the
    compiler, for a GPU machine without it (``MXMOE_GPU_PLANS=root``): ``python -c "import sys; sys.path[:0] =
    ['tests/mxmoe']; import test_distributed as t; t.write_cuda_artifacts('build/gpu_plans')"``."""
    for layout in dict.fromkeys(cut for cut, *_ in _CUDA_CUTS):
        path = _cuda_artifact_path(root, layout)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_cuda_artifact(path, layout)


def _write_cuda_artifact(path: str, layout: str) -> None:
    from mxmoe.shard_artifact import save_sharded

    save_sharded(_layer(_CUDA_CASE), path, layout, target="cuda:sm_90")


def _cuda_sharded_artifact(layout: str, tmp_path) -> str:
    """The test layer cut by ``layout`` for cuda:sm_90: from ``$MXMOE_GPU_PLANS`` (written by
    :func:`write_cuda_artifacts`), else compiled here into ``tmp_path``."""
    plans = os.environ.get("MXMOE_GPU_PLANS")
    if plans and os.path.exists(_cuda_artifact_path(plans, layout)):
        return _cuda_artifact_path(plans, layout)
    pytest.importorskip("iree.compiler", reason="no compiler here and no artifact in MXMOE_GPU_PLANS")
    path = str(tmp_path / "part.mxmoe")
    _write_cuda_artifact(path, layout)
    return path


@pytest.mark.gpu
@pytest.mark.parametrize("mode, dispatch, counts, hot", [
    ("ep", "allgather", [7, 0], ()), ("ep", "all_to_all", [5, 9], ()), ("ep", "all_to_all", [6, 5], (0, 1)),
    ("tp", "allgather", [3, 11], ())])
def test_two_gpus_over_nccl_match_the_layer(mode, dispatch, counts, hot, tmp_path):
    """The exchanges over NCCL between two GPUs (each rank's experts in eager torch on its GPU): the layer's output
    for every rank's tokens, a rank with none, all tokens on rank 0's experts, the same bits twice."""
    _need_gpus(2)
    results = _check(2, {"mode": mode, "dispatch": dispatch, "counts": counts, "hot": hot, "repeat": 2, "nccl": True},
                     tmp_path)
    if hot:  # two forwards
        assert results[0][2]["expert_rows"] == 2 * sum(counts) and results[1][2]["expert_rows"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout, dispatch, counts", _CUDA_CUTS)
def test_cuda_sharded_artifact_over_nccl(layout, dispatch, counts, tmp_path):
    """Each GPU loads its part of a cuda:sm_90 sharded artifact (the Triton kernels with the expert map / a tp
    slice) and the ranks exchange over NCCL: the layer's output, the same bits twice."""
    _need_gpus(len(counts))
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the test's artifacts are compiled for sm_90")
    case = dict(_CUDA_CASE, counts=counts, dispatch=dispatch, repeat=2, nccl=True,
                part=_cuda_sharded_artifact(layout, tmp_path))
    _check(len(counts), case, tmp_path)


def test_auto_dispatch_sends_to_the_ranks_of_the_experts_only_where_that_saves_bytes():
    """All-to-all where a token's experts reach at most 3/4 of the ranks (8 ranks, top-4), the all-gather where they
    reach nearly all (2 ranks, top-4: measured slower on two GPUs)."""
    from mxmoe.distributed import ShardedMoE, ShardSpec

    layer = MoE.random(_cfg(num_experts=16, top_k=4), seed=0)
    assert ShardedMoE(layer, ShardSpec(8, 1, 0))._reach() < 0.75 < ShardedMoE(layer, ShardSpec(2, 1, 0))._reach()


def test_ranks_that_disagree_get_a_clear_error(tmp_path):
    results, _ = _run(2, {"mode": "ep", "counts": [2, 2], "disagree": True}, tmp_path)
    for r in range(2):
        assert results[r][0] == "error" and "ranks disagree on the layer" in results[r][1], results[r]


def test_a_dead_rank_is_an_error_within_the_timeout(tmp_path):
    results, codes = _run(2, {"mode": "ep", "counts": [2, 2], "die": 1, "timeout": 10}, tmp_path)
    assert codes[1] == 3
    assert results[0][0] == "error" and "DistributedError" in results[0][1], results[0]


def test_bad_modes_are_named():
    from mxmoe.distributed import ShardSpec, parse_mode

    with pytest.raises(ValueError, match="ep x tp = 2 x 2 = 4 ranks, but the group has 2"):
        parse_mode({"ep": 2, "tp": 2}, 2)
    with pytest.raises(ValueError, match='"ep\\+tp" needs the split'):
        parse_mode("ep+tp", 4)
    with pytest.raises(ValueError, match="intermediate size \\(96\\) to be a multiple of tp x 32 = 64"):
        ShardSpec(1, 2, 0).intermediate(96)


# ============================================================================================ without ranks

def test_compile_shard_on_the_command_line(tmp_path, capsys):
    """``mxmoe compile --shard ep:4``: one artifact, four weight sets of the right experts; ``inspect`` says so;
    ``run`` needs a rank's set and checks it against the reference of that part; bad layouts are one-line errors."""
    import numpy as np

    import mxmoe.runtime
    from mxmoe.cli import main
    from mxmoe.core.config import preset
    from mxmoe.distributed import ShardSpec, shard_weights
    from mxmoe.runtime.loader import logical_parameters, parameter_arrays, open_artifact

    art = tmp_path / "tiny.mxmoe"
    assert main(["compile", "--preset", "tiny", "--target", "cpu", "--shard", "ep:4", "--seed", "3", "-o", str(art),
                 "-q"]) == 0
    out = capsys.readouterr().out
    assert "cut ep=4 x tp=1 = 4 ranks (2 experts x intermediate 96 a rank)" in out and "4 weight sets" in out
    assert main(["inspect", str(art)]) == 0
    assert "sharded     ep=4 x tp=1 = 4 ranks of a layer of 8 experts" in capsys.readouterr().out
    whole = MoE.random(preset("tiny"), seed=3).to_weights()
    opened = open_artifact(art)
    for r in range(4):  # each set holds exactly rank r's experts and expert map
        stored, name = parameter_arrays(opened, weight_set=f"rank.{r}")
        got, want = logical_parameters(opened, stored), shard_weights(whole, ShardSpec(4, 1, r))
        assert name == f"rank.{r}"
        assert np.array_equal(got["w13"], want.w13) and np.array_equal(got["expert_map"], want.expert_map)
    assert main(["run", str(art), "--weight-set", "rank.3", "--check", "--repeat", "1", "-q"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["run", str(art), "-q"]) == 1
    assert "sharded over 4 ranks (ep=4, tp=1); pass rank=R" in capsys.readouterr().err
    with pytest.raises(mxmoe.runtime.ArtifactError, match="rank 4 is outside this artifact's 4 ranks"):
        mxmoe.runtime.load(art, rank=4)
    assert mxmoe.runtime.load(art, rank=2).weight_set == "rank.2"
    for layout, words in (("tp:2", "intermediate size (96) to be a multiple of tp x 32 = 64"),
                          ("ep:3", "needs the expert count (8) to be a multiple of 3"),
                          ("ep4", "shard layout must look like ep:4"), ("ep:2,ep:2", "shard layout must look like")):
        assert main(["compile", "--preset", "tiny", "--target", "cpu", "--shard", layout, "-o",
                     str(tmp_path / "x.mxmoe"), "-q"]) == 1
        err = capsys.readouterr().err
        assert words in err and err.count("mxmoe: error:") == 1, err


def test_a_plain_artifact_is_not_a_shard(tmp_path):
    import mxmoe
    import mxmoe.runtime

    art = tmp_path / "plain.mxmoe"
    mxmoe.compile(_layer({}), "cpu").save(art)
    with pytest.raises(mxmoe.runtime.ArtifactError, match="rank=1 given, but this artifact is not sharded"):
        mxmoe.runtime.load(art, rank=1)


def test_a_whole_checkpoint_in_one_sharded_artifact(checkpoint_artifact, capsys):
    """Every layer of the checkpoint, every rank: sets layer.N.rank.R holding layer N's experts of rank R; a rank's
    part needs its layer named."""
    import numpy as np

    import mxmoe.runtime
    from mxmoe.cli import main
    from mxmoe.core.checkpoint import read_hf_gpt_oss
    from mxmoe.distributed import ShardSpec, shard_weights
    from mxmoe.runtime.loader import logical_parameters, open_artifact, parameter_arrays

    ckpt_dir, path = checkpoint_artifact
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "layer.N.rank.R is rank R's part of layer N" in out and "4 set(s)" in out
    opened = open_artifact(path)
    for n in (0, 2):
        whole = read_hf_gpt_oss(ckpt_dir, n)
        for r in range(2):
            got = logical_parameters(opened, parameter_arrays(opened, weight_set=f"layer.{n}.rank.{r}")[0])
            want = shard_weights(whole, ShardSpec(2, 1, r))
            assert np.array_equal(got["w2"], want.w2) and np.array_equal(got["w13_scale"], want.w13_scale)
    assert mxmoe.runtime.load(path, rank=1, layer=2).weight_set == "layer.2.rank.1"
    with pytest.raises(mxmoe.runtime.ArtifactError, match=r"holds 2 sharded layers \(layer.0, layer.2\); pass layer=N"):
        mxmoe.runtime.load(path, rank=1)
    with pytest.raises(mxmoe.runtime.ArtifactError, match="pass layer=N of them, not 1"):
        mxmoe.runtime.load(path, rank=1, layer=1)
