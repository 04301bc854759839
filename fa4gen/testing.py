"""Reference attention in PyTorch for checking kernels (any device, any dtype).

``reference(spec, q, k, v)`` computes what the spec means, in float32 by default; with
``upcast=False`` it computes in the inputs' own dtype, which gives PyTorch's own low-precision
error: a kernel passes when its error against the fp32 reference is at most twice that
(plus a small absolute floor for outputs that are near zero), the rule FlashAttention uses.
"""

from __future__ import annotations

import math

from fa4gen.expr import evaluate_torch
from fa4gen.spec import AttentionSpec
from fa4gen.variants import lower, standard_alibi_slopes


def visible_keys(spec: AttentionSpec, seqlen_q: int, seqlen_k: int, device=None, args=None):
    """Boolean (B or 1, 1, Sq, Sk): which keys each query sees (bottom-right aligned), written
    independently of the kernel's row intervals: per (query, key) pair, from positions and
    document ids. ``args`` holds the run-time values (prefix_lengths, cu_seqlens_q/k)."""
    import torch

    args = args or {}
    q_pos = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    k_pos = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    mask = torch.ones(1, 1, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if spec.mask_kind == "document":
        cu_q, cu_k = args["cu_seqlens_q"].long(), args["cu_seqlens_k"].long()
        doc_q = torch.searchsorted(cu_q, q_pos, right=True) - 1
        doc_k = torch.searchsorted(cu_k, k_pos, right=True) - 1
        mask &= doc_q == doc_k
        # align each document bottom-right: query i of a document ends where its keys end
        q_pos = q_pos - cu_q[doc_q] + (cu_k[doc_q + 1] - cu_k[doc_q]) - (cu_q[doc_q + 1] - cu_q[doc_q])
        k_pos = k_pos - cu_k[doc_k]
    else:
        end = cache_lengths(args, seqlen_k)
        q_pos = q_pos + (end - seqlen_q)
        if args.get("seqused_k") is not None:  # each entry's keys end at its own cache length
            mask = mask & (k_pos < end)
    if spec.right_bound is not None:
        mask &= k_pos <= q_pos + spec.right_bound
    if spec.left_bound is not None:
        mask &= k_pos >= q_pos - spec.left_bound
    if spec.mask_kind == "chunked":
        mask &= (k_pos // spec.mask.size) == (q_pos.clamp(min=0) // spec.mask.size)
    if spec.mask_kind == "prefix_lm":
        prefix = args["prefix_lengths"].long().view(-1, 1, 1, 1)
        mask = mask & ((k_pos <= q_pos) | (k_pos < prefix))
    return mask


def cache_lengths(args: dict, seqlen_k: int):
    """Where each batch entry's keys end: ``seqused_k`` (clamped to the cache's Sk, as the kernel
    does) as a (B, 1, 1, 1) tensor, or Sk for all."""
    used = args.get("seqused_k")
    return seqlen_k if used is None else used.long().clamp(0, seqlen_k).view(-1, 1, 1, 1)


def visible_mask(
    spec: AttentionSpec, seqlen_q: int, seqlen_k: int, device=None, args=None, env=None, batch: int = 1, heads: int = 1
):
    """visible_keys AND the spec's expression mask (evaluated with torch), broadcastable to
    (batch, heads, Sq, Sk)."""
    mask = visible_keys(spec, seqlen_q, seqlen_k, device=device, args=args)
    lowered = lower(spec)
    if lowered.mask is not None:
        if env is None:
            env = _expression_env(spec, None, (batch, heads, seqlen_q, seqlen_k), device, args or {})
        mask = mask & evaluate_torch(lowered.mask, env).bool()
    return mask


def _expression_env(spec: AttentionSpec, scores, shape, device, args):
    """The expression language's variables as broadcastable tensors over (B, H, Sq, Sk)."""
    import torch

    batch, heads, seqlen_q, seqlen_k = shape
    env = {
        "score": scores,
        "b": torch.arange(batch, device=device).view(-1, 1, 1, 1),
        "h": torch.arange(heads, device=device).view(1, -1, 1, 1),
        "q_idx": torch.arange(seqlen_q, device=device).view(1, 1, -1, 1),
        "kv_idx": torch.arange(seqlen_k, device=device).view(1, 1, 1, -1),
        "seqlen_q": seqlen_q,
        "seqlen_k": seqlen_k,
    }
    env.update({name: value for name, value in args.items() if name != "aux"})
    env["seqlen_k"] = cache_lengths(args, seqlen_k)
    env.update(args.get("aux", {}))
    if spec.score_mod is not None and spec.score_mod.kind == "alibi" and args.get("alibi_slopes") is None:
        env["alibi_slopes"] = torch.tensor(standard_alibi_slopes(heads), device=device)
    return env


def _handwritten_score_mod(spec: AttentionSpec, scores, env):
    """ALiBi and relative bias written out directly (not through the expression language)."""
    mod = spec.score_mod
    distance = env["kv_idx"] - env["q_idx"] - (env["seqlen_k"] - env["seqlen_q"])
    if mod.kind == "alibi":
        return scores - env["alibi_slopes"].view(1, -1, 1, 1) * distance.abs()
    if mod.kind == "relative_bias":
        bucket = distance.clamp(-mod.max_distance, mod.max_distance) + mod.max_distance
        return scores + env["rel_bias"][:, bucket.view(-1)].view(1, -1, *distance.shape[2:])
    raise ValueError(f"no hand-written reference for score_mod kind {mod.kind!r}")


def reference(spec: AttentionSpec, q, k, v, *, upcast: bool = True, args=None, independent: bool = False):
    """(o, lse): o (B, Sq, Hq, Dv) in q's dtype or float32 (upcast), lse (B, Hq, Sq) float32.

    ``args`` holds the variant's run-time values by keyword (sinks, alibi_slopes, rel_bias,
    prefix_lengths, cu_seqlens_q/k, seqused_k, page_table, aux={...}). Score modifiers and
    expression masks come from the expression language's PyTorch rendering; with ``independent``
    the built-in modifiers (ALiBi, relative bias) use hand-written formulas instead. With a
    document mask q, k, v (and the results) are packed (total, H, D); with a page table k and v
    are a page pool (pages, page size, Hkv, D), gathered first (``gather_pages``)."""
    args = dict(args or {})
    table = args.pop("page_table", None)
    if table is not None:
        k, v = gather_pages(k, table), gather_pages(v, table)
    if spec.is_varlen:
        out, lse = _reference(spec, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), upcast, args, independent)
        return out.squeeze(0), lse.squeeze(0)
    return _reference(spec, q, k, v, upcast, args, independent)


def gather_pages(pool, page_table):
    """A page pool (pages, page size, H, D) read through ``page_table`` (B, max pages) as the
    contiguous cache (B, max pages x page size, H, D), each entry clamped into the pool as the
    paged kernel does."""
    pages, page_size = pool.shape[:2]
    gathered = pool[page_table.long().clamp(0, pages - 1)]  # (B, max pages, page size, H, D)
    return gathered.reshape(page_table.shape[0], page_table.shape[1] * page_size, *pool.shape[2:])


def _reference(spec, q, k, v, upcast, args, independent):
    import torch

    dtype = torch.float32 if upcast else q.dtype
    qh = q.to(dtype).transpose(1, 2)  # (B, Hq, Sq, D)
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(spec.qhead_per_kvhead, dim=1)
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(spec.qhead_per_kvhead, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * spec.scale
    lowered = lower(spec)
    env = _expression_env(spec, scores, tuple(scores.shape), scores.device, args)
    if lowered.score is not None:
        builtin = spec.score_mod.kind in ("alibi", "relative_bias")
        modified = (
            _handwritten_score_mod(spec, scores, env) if independent and builtin else evaluate_torch(lowered.score, env)
        )
        scores = modified.to(scores.dtype) if not upcast else modified.float()
    if spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    mask = visible_mask(spec, q.shape[1], k.shape[1], device=q.device, args=args, env=env)
    scores = scores.masked_fill(~mask, float("-inf"))
    if spec.sinks:
        sink = args["sinks"].to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs, lse = _softmax_and_lse(scores)
    if spec.sinks:
        probs = probs[..., :-1]  # the sink takes probability but carries no value
    out = torch.matmul(probs, vh).transpose(1, 2)
    return out.contiguous(), lse


def _softmax_and_lse(scores):
    """softmax over the last dim and its log-sum-exp (float32), with rows that see no key giving
    probabilities 0 and LSE -inf, and differentiable everywhere (no NaN in their gradients:
    every division and log is guarded with the double-``where`` pattern)."""
    import torch

    largest = scores.amax(dim=-1, keepdim=True)
    largest = torch.where(torch.isfinite(largest), largest, torch.zeros_like(largest)).detach()
    exps = torch.exp(scores - largest)
    total = exps.sum(dim=-1, keepdim=True)
    seen = total > 0
    probs = exps / torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, torch.log(torch.where(seen, total, torch.ones_like(total))) + largest, -torch.inf)
    return probs, lse.squeeze(-1).float()


def reference_gradients(spec: AttentionSpec, q, k, v, dout, *, upcast: bool = True, dlse=None, args=None):
    """(dq, dk, dv) of the reference by torch.autograd, in float32 (``upcast``) or in the inputs'
    dtype, for the loss sum(out * dout) (+ sum(lse * dlse) where given and the LSE is finite);
    ``args``: the variant's run-time values, as for ``reference``. With sinks, the sink logits'
    gradient (float32) comes fourth; then those of the run-time tensors the spec trains
    (``requires_grad``), in the backward kernel's order."""
    import torch

    dtype = torch.float32 if upcast else q.dtype
    args = dict(args or {})
    with torch.enable_grad():  # (also from inside a backward pass, where autograd turned it off)
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        if spec.sinks:
            args["sinks"] = args["sinks"].detach().float().requires_grad_()
            leaves.append(args["sinks"])
        args["aux"] = dict(args.get("aux") or {})
        for extra in lower(spec).trainable:
            holder = args["aux"] if extra.role == "aux" else args
            key = extra.name if extra.role == "aux" else extra.role
            holder[key] = holder[key].detach().float().requires_grad_()
            leaves.append(holder[key])
        out, lse = reference(spec, *leaves[:3], upcast=upcast, args=args)
        loss = (out.float() * dout.float()).sum()
        if dlse is not None:
            finite = torch.isfinite(lse)
            loss = loss + torch.where(finite, lse, torch.zeros_like(lse)).mul(dlse).sum()
        loss.backward()
    return tuple(leaf.grad.float() for leaf in leaves)


def stored_output_dlse(spec: AttentionSpec, q, k, v, dout, *, dlse=None, args=None):
    """The LSE gradient under which the float32 reference's gradients are those of a backward
    whose dPsum (rowsum(dO * O)) reads the forward's output as stored, in q's dtype: every flash
    backward's. Its dS = P (dP - dPsum - e) is the exact one less P e, and P is the LSE's
    gradient, so its gradients are the reference's with the LSE's gradient lowered by e =
    rowsum(dO * (stored O - O))."""
    out, _ = reference(spec, q, k, v, args=args)
    shift = (dout.float() * (out.to(q.dtype).float() - out)).sum(-1).transpose(-1, -2)
    return -shift if dlse is None else dlse - shift


def assert_gradients_close(
    spec: AttentionSpec, q, k, v, dout, grads, *, dlse=None, args=None, factor: float = 2.0
) -> dict:
    """Raise AssertionError naming the gradient if dq, dk, dv (or the sinks', or a trained tensor's)
    miss factor x PyTorch's own error (autograd of the reference in the inputs' dtype against
    float32), plus a floor of 1e-4 of the largest gradient; return the errors. Where reading the
    stored output (``stored_output_dlse``) moves a gradient further than PyTorch's own error,
    that error counts instead: a reduction to a few values (ALiBi slopes, sinks) may come out of
    PyTorch's bf16 path with less error than the output's rounding alone causes."""
    import torch

    exact = reference_gradients(spec, q, k, v, dout, dlse=dlse, args=args)
    low = reference_gradients(spec, q, k, v, dout, upcast=False, dlse=dlse, args=args)
    stored_dlse = stored_output_dlse(spec, q, k, v, dout, dlse=dlse, args=args)
    stored = reference_gradients(spec, q, k, v, dout, dlse=stored_dlse, args=args)
    report = {}
    # the floor scales with the largest gradient: a gradient that cancels to ~0 (dK with one key)
    # is judged against the size of the terms it cancels, not against itself
    scale = max((ref.abs().max().item() for ref in exact if ref.numel()), default=0.0)
    names = ("dq", "dk", "dv", *(("dsinks",) if spec.sinks else ()), *(f"d{e.name}" for e in lower(spec).trainable))
    for name, got, ref, own, read in zip(names, grads, exact, low, stored, strict=True):
        assert not torch.isnan(got).any(), f"{name} has NaN (poisoned entries were not overwritten?)"
        err, reference_error = 0.0, 0.0
        if ref.numel():
            err = (got.float() - ref).abs().max().item()
            reference_error = max((own - ref).abs().max().item(), (read - ref).abs().max().item())
        bound = factor * reference_error + 1e-4 * scale + 1e-6
        report[name] = (err, bound)
        assert err <= bound, f"{name} error {err:.3e} exceeds 2x PyTorch's own error bound {bound:.3e}"
    return report


def error_bound(spec: AttentionSpec, q, k, v, out_ref, *, factor: float = 2.0, floor: float = 1e-5, args=None) -> float:
    """factor x the max error of PyTorch's own computation in the inputs' dtype."""
    low, _ = reference(spec, q, k, v, upcast=False, args=args)
    return factor * (low.float() - out_ref).abs().max().item() + floor


def attention_flops(spec: AttentionSpec, batch: int, seqlen_q: int, seqlen_k: int, heads: int, args=None) -> float:
    """Useful forward FLOPs: 2*d (Q.K^T) + 2*dv (P.V) per visible (query, key) pair; masks with
    run-time parts count their visible pairs from ``args``."""
    if spec.mask_kind is not None:  # count the mask itself
        import torch

        values = [*(args or {}).values(), *(args or {}).get("aux", {}).values()]
        device = next((t.device for t in values if isinstance(t, torch.Tensor)), None)
        mask = visible_mask(spec, seqlen_q, seqlen_k, device=device, args=args, batch=batch, heads=heads)
        # per batch entry and head (prefix-LM and expression masks may differ between them)
        visible = mask.sum().item() / (mask.shape[0] * mask.shape[1])
    else:
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


def assert_close_to_reference(
    spec: AttentionSpec, q, k, v, out, lse=None, *, args=None, independent: bool = False
) -> dict:
    """Raise AssertionError with the errors if ``out`` (and ``lse``) miss the bound; return them."""
    import torch

    out_ref, lse_ref = reference(spec, q, k, v, args=args, independent=independent)
    bound = error_bound(spec, q, k, v, out_ref, args=args)
    assert not torch.isnan(out).any(), "output has NaN (poisoned entries were not overwritten?)"
    err = (out.float() - out_ref).abs().max().item()
    report = {"out_err": err, "out_bound": bound}
    assert err <= bound, f"output error {err:.3e} exceeds 2x PyTorch's own error bound {bound:.3e}"
    if lse is not None:
        assert not torch.isnan(lse).any(), "lse has NaN"
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite), "lse is -inf exactly where no key is visible"
        lse_err = (lse[finite] - lse_ref[finite]).abs().max().item() if finite.any() else 0.0
        keys = k.shape[-3] * (1 if (args or {}).get("page_table") is None else args["page_table"].shape[1])
        lse_bound = 1e-3 * max(1.0, math.log(max(keys, 2)))
        report.update(lse_err=lse_err, lse_bound=lse_bound)
        assert lse_err <= lse_bound, f"lse error {lse_err:.3e} exceeds {lse_bound:.3e}"
    return report
