"""The routing contract's tie rules as references and benchmarks use them (mxmoe.torch_frontend.ties)."""

import numpy as np
import torch

from mxmoe.torch_frontend.ties import near_tie_tokens, top_k


def test_top_k_breaks_ties_to_the_lower_index():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0], [0.5, 0.5, 0.5, 0.5, 0.5]])
    vals, ids = top_k(x, 3)
    assert ids.tolist() == [[1, 3, 2], [0, 1, 2]]
    assert vals.tolist() == [[3.0, 3.0, 2.0], [0.5, 0.5, 0.5]]


def test_top_k_matches_the_numpy_reference_on_random_bf16_logits_with_ties():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(512, 32, generator=g) * 4).to(torch.bfloat16).float()  # bf16 values tie often
    _, ids = top_k(logits, 4)
    ref = np.argsort(-logits.numpy(), axis=-1, kind="stable")[:, :4]  # core.reference's rule, written out
    assert np.array_equal(ids.numpy(), ref)
    v, _ = torch.sort(logits, dim=-1, descending=True)
    assert bool((v[:, 3] == v[:, 4]).any())  # the case this is about occurs here


def test_near_ties_are_flagged_within_two_ulps_of_the_logits_dtype():
    # bf16 logits around 4: one ulp is 2^-5; fp32 logits around 4: one ulp of the allowance is 2^-11
    base = torch.tensor([[8.0, 4.0, 4.0 - 2 * 2 ** -5, 1.0], [8.0, 4.0, 4.0 - 4 * 2 ** -5, 1.0]])
    assert near_tie_tokens(base.to(torch.bfloat16), 2).tolist() == [True, False]
    f32 = torch.tensor([[8.0, 4.0, 4.0 - 2 ** -11, 1.0], [8.0, 4.0, 4.0 - 2 ** -8, 1.0]])
    assert near_tie_tokens(f32, 2).tolist() == [True, False]
    assert near_tie_tokens(base, 4).tolist() == [False, False]  # k = E: nothing left to tie with
