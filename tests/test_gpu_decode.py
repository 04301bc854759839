"""The decode kernel (fa4gen.kernels.sm90.decode) against the fp32 reference on the GPU.

Launches over a KV cache: short query sequences, per-entry cache lengths (``seqused_k``, incl. 0
and 1), the keys split over 1 to many CTAs (the split count forced here, chosen by size in
production), with every mask and score modifier the decode kernel takes. Outputs are poisoned
with NaN first; the bound is 2x PyTorch's own bf16 error (fa4gen.testing). Kernels come from the
cache, warmed by tests/warm_gpu_cache.py.
"""

from __future__ import annotations

import pytest
from gpu_cases import decode_specs, variant_inputs

import fa4gen
import fa4gen.kernels.sm90.decode_config as decode_config
from fa4gen.testing import assert_close_to_reference

pytestmark = pytest.mark.gpu

SPECS = decode_specs()
KV_HEADS = 2
# (batch, Sq, cache capacity Sk): one key; ragged tiles; Sq past one packed tile with seqused_k
SHAPES = [(1, 1, 1), (3, 1, 1000), (2, 4, 4097), (4, 2, 333), (1, 16, 2000)]


def _lengths(batch: int, capacity: int, seed: int):
    """Cache lengths with the edges: 0, 1 and the full capacity among random ones."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, capacity + 1, (batch,), generator=gen)
    edges = [0, 1, capacity]
    for i in range(min(batch, len(edges))):
        lengths[i] = edges[(i + seed) % len(edges)]
    return lengths.to(torch.int32).cuda()


def _run(spec, attn, q, k, v, args):
    import torch

    out = torch.full((*q.shape[:-1], spec.dv), float("nan"), device="cuda", dtype=q.dtype)
    lse = None
    if spec.return_lse:
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda")
        attn(q, k, v, out=out, lse=lse, **args)
    else:
        attn(q, k, v, out=out, **args)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("splits", [1, 3, None], ids=["1split", "3splits", "auto"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_decode_with_cache_lengths(name, shape, splits, monkeypatch):
    spec = SPECS[name]
    if splits is not None:
        monkeypatch.setattr(decode_config, "decode_splits", lambda *sizes: splits)
    attn = fa4gen.compile(spec)
    seed = hash((name, shape, splits)) % 2**31
    q, k, v, args = variant_inputs(spec, *shape, seed=seed, kv_heads=KV_HEADS)
    args["seqused_k"] = _lengths(shape[0], shape[2], seed)
    out, lse = _run(spec, attn, q, k, v, args)
    assert_close_to_reference(spec, q, k, v, out, lse, args=args)


@pytest.mark.parametrize("splits", [1, 5], ids=["1split", "5splits"])
@pytest.mark.parametrize("name", ["llama-gqa4", "window-sinks", "mha-d64"])
def test_plain_decode_launch_picks_the_decode_kernel(name, splits, monkeypatch):
    """Without cache lengths a short query launch runs the decode kernel too (its length range),
    every key of the cache visible."""
    spec = SPECS[name]
    monkeypatch.setattr(decode_config, "decode_splits", lambda *sizes: splits)
    attn = fa4gen.compile(spec)
    assert attn.kernel_for(1).plan.kernel == "HopperAttentionDecode"
    q, k, v, args = variant_inputs(spec, 2, 1, 3001, seed=splits, kv_heads=KV_HEADS)
    out, lse = _run(spec, attn, q, k, v, args)
    assert_close_to_reference(spec, q, k, v, out, lse, args=args)


def test_cache_lengths_past_the_capacity_are_clamped():
    """A length past the cache (or negative) reads no key outside it: clamped to [0, Sk]."""
    import torch

    spec = SPECS["llama-gqa4"]
    attn = fa4gen.compile(spec)
    q, k, v, args = variant_inputs(spec, 3, 1, 500, seed=7, kv_heads=KV_HEADS)
    out, lse = _run(spec, attn, q, k, v, {"seqused_k": torch.tensor([10**6, -5, 250], dtype=torch.int32).cuda()})
    lengths = torch.tensor([500, 0, 250], dtype=torch.int32).cuda()
    assert_close_to_reference(spec, q, k, v, out, lse, args={"seqused_k": lengths})
