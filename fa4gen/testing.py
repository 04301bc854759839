"""Reference attention in PyTorch for checking kernels (any device, any dtype).

``reference(spec, q, k, v)`` computes what the spec means, in float32 by default; with
``upcast=False`` it computes in the inputs' own dtype, which gives PyTorch's own low-precision
error: a kernel passes when its error against the fp32 reference is at most twice that
(plus a small absolute floor for outputs that are near zero), the rule FlashAttention uses.
"""

from __future__ import annotations

import math

from fa4gen.spec import AttentionSpec


def visible_keys(spec: AttentionSpec, seqlen_q: int, seqlen_k: int, device=None):
    """Boolean (Sq, Sk): which keys each query sees (bottom-right aligned)."""
    import torch

    rows = torch.arange(seqlen_q, device=device).view(-1, 1) + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device).view(1, -1)
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if spec.right_bound is not None:
        mask &= cols <= rows + spec.right_bound
    if spec.left_bound is not None:
        mask &= cols >= rows - spec.left_bound
    return mask


def reference(spec: AttentionSpec, q, k, v, *, upcast: bool = True):
    """(o, lse): o (B, Sq, Hq, Dv) in q's dtype or float32 (upcast), lse (B, Hq, Sq) float32."""
    import torch

    dtype = torch.float32 if upcast else q.dtype
    qh = q.to(dtype).transpose(1, 2)  # (B, Hq, Sq, D)
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(spec.qhead_per_kvhead, dim=1)
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(spec.qhead_per_kvhead, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * spec.scale
    if spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    mask = visible_keys(spec, q.shape[1], k.shape[1], device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    out = torch.matmul(probs, vh).transpose(1, 2)
    return out.contiguous(), lse


def error_bound(spec: AttentionSpec, q, k, v, out_ref, *, factor: float = 2.0, floor: float = 1e-5) -> float:
    """factor x the max error of PyTorch's own computation in the inputs' dtype."""
    low, _ = reference(spec, q, k, v, upcast=False)
    return factor * (low.float() - out_ref).abs().max().item() + floor


def attention_flops(spec: AttentionSpec, batch: int, seqlen_q: int, seqlen_k: int, heads: int) -> float:
    """Useful forward FLOPs: 2*d (Q.K^T) + 2*dv (P.V) per visible (query, key) pair."""
    visible = _visible_pairs(spec, seqlen_q, seqlen_k)
    return 2.0 * batch * heads * visible * (spec.head_dim + spec.dv)


def _visible_pairs(spec: AttentionSpec, seqlen_q: int, seqlen_k: int) -> int:
    total = 0
    offset = seqlen_k - seqlen_q
    for row in range(seqlen_q):
        hi = seqlen_k - 1 if spec.right_bound is None else min(seqlen_k - 1, row + offset + spec.right_bound)
        lo = 0 if spec.left_bound is None else max(0, row + offset - spec.left_bound)
        total += max(0, hi - lo + 1)
    return total


def assert_close_to_reference(spec: AttentionSpec, q, k, v, out, lse=None) -> dict:
    """Raise AssertionError with the errors if ``out`` (and ``lse``) miss the bound; return them."""
    import torch

    out_ref, lse_ref = reference(spec, q, k, v)
    bound = error_bound(spec, q, k, v, out_ref)
    assert not torch.isnan(out).any(), "output has NaN (poisoned entries were not overwritten?)"
    err = (out.float() - out_ref).abs().max().item()
    report = {"out_err": err, "out_bound": bound}
    assert err <= bound, f"output error {err:.3e} exceeds 2x PyTorch's own error bound {bound:.3e}"
    if lse is not None:
        assert not torch.isnan(lse).any(), "lse has NaN"
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite), "lse is -inf exactly where no key is visible"
        lse_err = (lse[finite] - lse_ref[finite]).abs().max().item() if finite.any() else 0.0
        lse_bound = 1e-3 * max(1.0, math.log(max(k.shape[1], 2)))
        report.update(lse_err=lse_err, lse_bound=lse_bound)
        assert lse_err <= lse_bound, f"lse error {lse_err:.3e} exceeds {lse_bound:.3e}"
    return report
