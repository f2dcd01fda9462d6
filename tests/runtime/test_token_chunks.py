"""A CPU module's long calls run in pieces of tokens (runtime/module.py, IreeCode.token_chunk)."""

import numpy as np
import pytest
import torch

from mxmoe.core.signature import TensorSpec
from mxmoe.runtime.code import CPU_TOKEN_CHUNK_ENV, IreeCode
from mxmoe.runtime.module import BoundModule

X = TensorSpec("x", "float32", (None, 3))
IDS = TensorSpec("ids", "int32", (None, 2))
TABLE = TensorSpec("table", "int32", (5,))
OUT = TensorSpec("out0", "float32", (None, 3))


class Recorder:
    """An executor that remembers the token counts it was called with: out = x * 2 + ids[:, :1] + table.sum()."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, ids, table):
        self.calls.append((len(x), len(ids), len(table)))
        return [x * 2 + ids[:, :1] + table.sum()]


def _inputs(n):
    rng = np.random.default_rng(n)
    return (rng.standard_normal((n, 3)).astype(np.float32), rng.integers(0, 9, (n, 2), dtype=np.int32),
            np.arange(5, dtype=np.int32))


@pytest.mark.parametrize("n, pieces", [(10, [(4, 4, 5), (4, 4, 5), (2, 2, 5)]), (8, [(4, 4, 5), (4, 4, 5)]),
                                       (4, [(4, 4, 5)]), (1, [(1, 1, 5)])])
def test_pieces_slice_the_per_token_inputs_and_join_the_outputs(n, pieces):
    ex = Recorder()
    mod = BoundModule([X, IDS, TABLE], [OUT], ex, takes_tensors=False, token_chunk=4)
    x, ids, table = _inputs(n)
    got = mod(x, ids, table)
    assert ex.calls == pieces  # equal pieces (but the last); the static input whole every time
    np.testing.assert_array_equal(got, x * 2 + ids[:, :1] + table.sum())


def test_unequal_token_counts_go_whole_to_the_module():
    """A per-token input whose count differs from the first input's: the module gets the call as it is."""
    calls = []

    def executor(x, ids, table):
        calls.append((len(x), len(ids), len(table)))
        return [x]

    mod = BoundModule([X, IDS, TABLE], [OUT], executor, takes_tensors=False, token_chunk=4)
    x, _, table = _inputs(9)
    mod(x, _inputs(7)[1], table)
    assert calls == [(9, 7, 5)]


def test_outputs_that_do_not_follow_the_tokens_are_never_split():
    ex = Recorder()
    mod = BoundModule([X, IDS, TABLE], [TensorSpec("out0", "float32", (3,))], ex, takes_tensors=False, token_chunk=4)
    assert mod.token_chunk is None
    mod(*_inputs(9))
    assert ex.calls == [(9, 9, 5)]


def test_the_chunk_follows_the_weights_and_only_on_the_cpu(monkeypatch):
    monkeypatch.delenv(CPU_TOKEN_CHUNK_ENV, raising=False)
    cpu, gpu = IreeCode(b"", driver="local"), IreeCode(b"", driver="hip")
    assert gpu.token_chunk(10**9, 64) is None
    assert cpu.token_chunk(8 * 5760 * 9000, 5760) == 9000  # weights / (8 x input row), within the range
    assert cpu.token_chunk(1000, 1024) == 1024 and cpu.token_chunk(10**12, 2) == 65536
    monkeypatch.setenv(CPU_TOKEN_CHUNK_ENV, "0")
    assert cpu.token_chunk(10**9, 64) is None
    monkeypatch.setenv(CPU_TOKEN_CHUNK_ENV, "33")
    assert cpu.token_chunk(10**9, 64) == 33
    for bad in ("-5", "lots", ""):
        monkeypatch.setenv(CPU_TOKEN_CHUNK_ENV, bad)
        with pytest.raises(ValueError, match="MXMOE_CPU_TOKEN_CHUNK must be a number of tokens"):
            cpu.token_chunk(10**9, 64)


def test_a_compiled_layer_in_pieces_matches_it_whole(monkeypatch):
    """The cpu target end to end: 300 tokens in pieces of 64 against one call (routing per token; only the f32
    summation order of a work item may move, which a row's result does not see here beyond rounding)."""
    import mxmoe
    from mxmoe.core.config import MoEConfig
    from mxmoe.torch_frontend.moe import MoE

    layer = MoE.random(MoEConfig(num_experts=8, top_k=3, hidden=64, intermediate=96), seed=3)
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    monkeypatch.setenv(CPU_TOKEN_CHUNK_ENV, "0")
    whole = mxmoe.compile(layer, target="cpu")
    assert whole.bound().entry().token_chunk is None
    monkeypatch.setenv(CPU_TOKEN_CHUNK_ENV, "64")
    pieces = mxmoe.compile(layer, target="cpu")
    assert pieces.bound().entry().token_chunk == 64
    a, b = whole(x).float(), pieces(x).float()
    assert (a - b).abs().max() <= 2 ** -7 * a.abs().max()  # one bf16 rounding at most
    assert (a == b).float().mean() > 0.95
