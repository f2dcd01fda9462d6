"""Sharded MoE layers over torch.distributed with gloo, 2 and 4 ranks spawned by the test: each mode (ep, tp,
ep+tp; allgather and all-to-all exchanges) against the single-process layer on the same weights and tokens,
including ranks with no tokens, all tokens on one rank's experts and uneven token counts; deterministic output;
clear errors when ranks disagree or one dies."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mxmoe.core.config import MoEConfig
from mxmoe.torch_frontend import MoE

TOL = 2e-2


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=8, top_k=2, hidden=64, intermediate=128, activation="silu", interleaved=False)
    base.update(kw)
    return MoEConfig(**base)


def _tokens(counts, h=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, generator=g).bfloat16() for n in counts]


def _worker(rank, world, init, case, results):
    """One rank: shard the layer, run its tokens, put (output, error) in ``results``."""
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=case.get("timeout", 60)))
        from mxmoe.distributed import shard

        layer = _layer(case, rank if case.get("disagree") else 0)
        sharded = shard(layer, case["mode"], dispatch=case.get("dispatch", "auto"))
        if case.get("compile"):
            sharded.compile(case["compile"])
        xs = _tokens(case["counts"], seed=case.get("seed", 0))
        if case.get("die") is not None and rank == case["die"]:
            os._exit(3)  # a rank that dies before the collective
        outs = [sharded(xs[rank]) for _ in range(case.get("repeat", 1))]
        results[rank] = ("ok", [o.float() for o in outs], sharded.stats)
        dist.destroy_process_group()
    except Exception as e:  # reported to the parent
        results[rank] = ("error", f"{type(e).__name__}: {e}", traceback.format_exc()[-2000:])


def _run(world, case, tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_worker, args=(r, world, f"file://{tmp_path}/init", case, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        return {r: results.get(r) for r in range(world)}, [p.exitcode for p in procs]


def _layer(case, seed_offset: int = 0) -> MoE:
    """The case's layer; ``hot`` experts get a router bias that makes every token pick them."""
    layer = MoE.random(_cfg(**case.get("cfg", {})), seed=case.get("layer_seed", 1) + seed_offset)
    with torch.no_grad():
        for e in case.get("hot", ()):
            layer.router_bias[e] += 100.0
    return layer


def _expect(case):
    layer = _layer(case)
    return [layer(x).float() if len(x) else x.float() for x in _tokens(case["counts"], seed=case.get("seed", 0))]


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


def test_a_rank_with_no_tokens_and_uneven_counts(tmp_path):
    _check(2, {"mode": "ep", "dispatch": "all_to_all", "counts": [0, 13]}, tmp_path)
    _check(2, {"mode": "tp", "dispatch": "allgather", "counts": [17, 0]}, tmp_path)


def test_all_tokens_on_one_ranks_experts(tmp_path):
    """A router that sends every token to experts 0 and 1 (rank 0's under ep): with the all-to-all exchange rank 1's
    experts run no rows at all, rank 0's run every token."""
    case = {"mode": "ep", "dispatch": "all_to_all", "counts": [6, 5], "hot": (0, 1)}
    results = _check(2, case, tmp_path)
    assert results[0][2]["expert_rows"] == 11 and results[1][2]["expert_rows"] == 0


def test_four_ranks_ep_tp_and_shared_experts(tmp_path):
    case = {"mode": {"ep": 2, "tp": 2}, "counts": [3, 0, 8, 5], "repeat": 2,
            "cfg": {"shared_intermediate": 64, "shared_gate": True, "bias": True}}
    _check(4, case, tmp_path)


def test_compiled_shards(tmp_path):
    """mxmoe.compile on each rank's shard (the cpu target with the row-major lowering, which skips other ranks'
    experts)."""
    from mxmoe.compiler.targets import get_target
    from mxmoe.core.layouts import ROW_MAJOR

    _check(2, {"mode": "ep", "counts": [7, 4], "compile": get_target("cpu").replace(layout=ROW_MAJOR)}, tmp_path)


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
