"""torch.export capture: the mxmoe custom ops stay single nodes, the token count stays dynamic."""

import pytest
import torch

from mxmoe.core.config import PRESETS
from mxmoe.torch_frontend import MoE, capture
from mxmoe.torch_frontend import ops

H = PRESETS["tiny"].hidden


def _mxmoe_targets(ep) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "mxmoe" in str(n.target)]


class ResidualBlock(torch.nn.Module):
    """A norm and a residual add around an MoE, as in a decoder layer."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.norm = torch.nn.RMSNorm(H, dtype=moe.dtype)
        self.moe = moe

    def forward(self, x):
        return x + self.moe(self.norm(x))


@pytest.fixture(scope="module")
def moe():
    return MoE.random("tiny", seed=0)


def test_bare_layer_keeps_custom_ops_and_dynamic_tokens(moe):
    ep = capture(moe, (torch.randn(1, H, dtype=torch.bfloat16),))   # a 1-token example still gives a dynamic dim
    assert _mxmoe_targets(ep) == ["mxmoe.route.default", "mxmoe.mxfp4_grouped_matmul.default",
                                  "mxmoe.glu.default", "mxmoe.mxfp4_grouped_matmul.default", "mxmoe.combine.default"]
    run = ep.module()
    for tokens in (1, 7, 3000):
        x = torch.randn(tokens, H, dtype=torch.bfloat16)
        assert torch.equal(run(x), moe(x))


def test_residual_block_around_the_layer(moe):
    block = ResidualBlock(moe)
    ep = capture(block, (torch.randn(4, H, dtype=torch.bfloat16),))
    assert len(_mxmoe_targets(ep)) == 5
    x = torch.randn(33, H, dtype=torch.bfloat16)
    assert torch.equal(ep.module()(x), block(x))


def test_batch_and_sequence_dims_are_both_dynamic(moe):
    ep = capture(moe, (torch.randn(2, 3, H, dtype=torch.bfloat16),))
    x = torch.randn(5, 1, H, dtype=torch.bfloat16)
    assert torch.equal(ep.module()(x), moe(x))


def test_static_capture_specialises(moe):
    ep = capture(moe, (torch.randn(4, H, dtype=torch.bfloat16),), dynamic=False)
    with pytest.raises(Exception):
        ep.module()(torch.randn(5, H, dtype=torch.bfloat16))


def test_empty_example_inputs_is_a_clear_error(moe):
    with pytest.raises(ValueError, match="example_inputs is empty"):
        capture(moe, ())


@pytest.mark.parametrize("call, match", [
    (lambda m: ops.route(torch.randn(3, 8), 9, "topk_softmax", False), r"top_k=9 must be in 1\.\.8"),
    (lambda m: ops.route(torch.randn(3, 8), 2, "sorted", False), "routing must be one of"),
    (lambda m: ops.route(torch.randn(3, 8, 1), 2, "topk_softmax", False), r"logits must be \[T, E\]"),
    (lambda m: ops.mxfp4_grouped_matmul(torch.randn(2, H), torch.zeros(2, 2, dtype=torch.int32),
                                        m.w13.float(), m.w13_scale, None), "w must be packed uint8"),
    (lambda m: ops.mxfp4_grouped_matmul(torch.randn(2, H + 32), torch.zeros(2, 2, dtype=torch.int32),
                                        m.w13, m.w13_scale, None), r"x must be \[T, 64\]"),
    (lambda m: ops.mxfp4_grouped_matmul(torch.randn(2, H), torch.zeros(2, 2, dtype=torch.int32),
                                        m.w13, m.w13_scale[:, :, :1], None), "w_scale must be"),
    (lambda m: ops.mxfp4_grouped_matmul(torch.randn(2, H), torch.zeros(2, 2, dtype=torch.int32),
                                        m.w13, m.w13_scale, m.w2_bias), "bias must be"),
    (lambda m: ops.glu(torch.randn(2, 5), "silu", 1.0, 7.0, True), "last dim must be even"),
    (lambda m: ops.glu(torch.randn(2, 4), "relu", 1.0, 7.0, True), "activation must be one of"),
    (lambda m: ops.combine(torch.randn(2, 3, 4), torch.randn(2, 2)), r"weights must be \[T, k\]"),
])
def test_custom_ops_reject_bad_inputs_by_name(moe, call, match):
    with pytest.raises(ValueError, match=match):
        call(moe)


def test_expert_ids_out_of_range_are_rejected(moe):
    ids = torch.full((2, 2), moe.config.num_experts, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expert ids must be in 0\.\.7 \(or -1: not this layer.s\), got 8\.\.8"):
        ops.mxfp4_grouped_matmul(torch.randn(2, H), ids, moe.w13, moe.w13_scale, None)
