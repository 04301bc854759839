"""The GPU tests' gradient bound (fa4gen.testing.assert_gradients_close), checked on the CPU.

A flash backward reads the forward's output as stored (bf16): its dPsum = rowsum(dO * O) carries
O's rounding into every dS. ``stored_output_dlse`` gives the float32 reference that same dPsum;
the bound admits the error it causes where PyTorch's own bf16 error happens to be smaller (a few
percent of random draws for a trained ALiBi slope at d256, B=3, S=17)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fa4gen import AttentionSpec  # noqa: E402
from fa4gen.testing import assert_gradients_close, reference, reference_gradients, stored_output_dlse  # noqa: E402

ALIBI_TRAIN = AttentionSpec(
    head_dim=256, causal=True, score_mod={"kind": "alibi", "slopes": "tensor", "requires_grad": True}
)
B, S, H = 3, 17, 2


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, S, H, ALIBI_TRAIN.head_dim, generator=gen).bfloat16() for _ in range(4))
    return q, k, v, dout, {"alibi_slopes": torch.randn(H, generator=gen).abs() * 0.1}


def _flash_gradients(q, k, v, dout, args):
    """dq, dk, dv and the slopes' gradient as a flash backward forms them, in float64 from the
    bf16 inputs: P from the scores, dP = dO.V^T, dPsum from the forward's output stored in bf16."""
    slopes = args["alibi_slopes"]
    stored = reference(ALIBI_TRAIN, q, k, v, args=args)[0].bfloat16().double().transpose(1, 2)
    qd, kd, vd, dod = (t.double().transpose(1, 2) for t in (q, k, v, dout))  # (B, H, S, D)
    rows, cols = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
    distance = (rows - cols).abs().double()
    scale = ALIBI_TRAIN.scale
    scores = qd @ kd.transpose(-1, -2) * scale - slopes.double().view(1, H, 1, 1) * distance
    probs = torch.softmax(scores.masked_fill(cols > rows, float("-inf")), dim=-1)
    dpsum = (dod * stored).sum(-1, keepdim=True)
    ds = probs * (dod @ vd.transpose(-1, -2) - dpsum)
    dq, dk, dv = ds @ kd * scale, ds.transpose(-1, -2) @ qd * scale, probs.transpose(-1, -2) @ dod
    return [t.transpose(1, 2).float() for t in (dq, dk, dv)] + [-(ds * distance).sum((0, 2, 3)).float()]


@pytest.mark.parametrize("seed", [11, 27, 30, 1, 2])
def test_the_stored_output_lse_gradient_gives_a_flash_backward_s_gradients(seed):
    q, k, v, dout, args = _inputs(seed)
    got = reference_gradients(
        ALIBI_TRAIN, q, k, v, dout, dlse=stored_output_dlse(ALIBI_TRAIN, q, k, v, dout, args=args), args=args
    )
    for name, found, want in zip(("dq", "dk", "dv", "dslopes"), got, _flash_gradients(q, k, v, dout, args)):
        torch.testing.assert_close(found, want, atol=2e-4 * want.abs().max().item(), rtol=0, msg=name)


@pytest.mark.parametrize("seed", [11, 27, 30])  # draws where PyTorch's own slope error is the smaller
def test_the_bound_admits_the_stored_output_s_rounding_and_nothing_much_more(seed):
    q, k, v, dout, args = _inputs(seed)
    flash = _flash_gradients(q, k, v, dout, args)
    exact = reference_gradients(ALIBI_TRAIN, q, k, v, dout, args=args)
    own = reference_gradients(ALIBI_TRAIN, q, k, v, dout, upcast=False, args=args)
    # the rounding alone is past 2x PyTorch's own slope error: the old bound failed these draws
    assert (flash[3] - exact[3]).abs().max() > 2 * (own[3] - exact[3]).abs().max()
    assert_gradients_close(ALIBI_TRAIN, q, k, v, dout, flash, args=args)
    # a slope gradient off by its whole rounding error again, three times over, is refused
    wrong = flash[:3] + [flash[3] + 3 * (flash[3] - exact[3])]
    with pytest.raises(AssertionError, match="dalibi_slopes"):
        assert_gradients_close(ALIBI_TRAIN, q, k, v, dout, wrong, args=args)
