"""Kernels against the fp32 reference on the GPU (marker `gpu`; skipped without one).

Kernels come from the cache (FA4GEN_CACHE_DIR), warmed beforehand with
``python tests/warm_gpu_cache.py DIR`` on any machine; here they are only loaded and run.
Outputs are poisoned with NaN before each launch, inputs are fresh random normals, and the
error bound is 2x PyTorch's own error in the input dtype (fa4gen.testing).
"""

from __future__ import annotations

import pytest

import fa4gen
from fa4gen.testing import assert_close_to_reference
from gpu_cases import SHAPES, gpu_specs, plan_option_cases

pytestmark = pytest.mark.gpu

CASES = gpu_specs()
KV_HEADS = 2


def _inputs(spec: fa4gen.AttentionSpec, batch: int, seqlen_q: int, seqlen_k: int, seed: int):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    heads_q = KV_HEADS * spec.qhead_per_kvhead

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    q = randn(batch, seqlen_q, heads_q, spec.head_dim)
    k = randn(batch, seqlen_k, KV_HEADS, spec.head_dim)
    v = randn(batch, seqlen_k, KV_HEADS, spec.dv)
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name, shape):
    import torch

    spec = CASES[name]
    attn = fa4gen.compile(spec)
    q, k, v = _inputs(spec, *shape, seed=hash((name, shape)) % 2**31)
    batch, seqlen_q, _ = shape
    heads_q = q.shape[2]
    out = torch.full((batch, seqlen_q, heads_q, spec.dv), float("nan"), device="cuda", dtype=q.dtype)
    lse = None
    if spec.return_lse:
        lse = torch.full((batch, heads_q, seqlen_q), float("nan"), device="cuda", dtype=torch.float32)
        result = attn(q, k, v, out=out, lse=lse)
        assert result[0] is out and result[1] is lse
    else:
        assert attn(q, k, v, out=out) is out
    torch.cuda.synchronize()
    assert_close_to_reference(spec, q, k, v, out, lse)


def test_allocates_outputs_and_runs_on_current_stream():
    import torch

    spec = CASES["llama3-8b"]
    attn = fa4gen.compile(spec)
    q, k, v = _inputs(spec, 2, 333, 555, seed=7)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = attn(q, k, v)
    stream.synchronize()
    assert out.shape == (2, 333, q.shape[2], spec.dv) and out.dtype == q.dtype
    assert_close_to_reference(spec, q, k, v, out)


def test_zero_batch_and_empty_queries():
    import torch

    spec = CASES["vit+lse"]
    attn = fa4gen.compile(spec)
    q, k, v = _inputs(spec, 1, 5, 5, seed=3)
    out, lse = attn(q[:, :0], k, v)
    assert out.shape == (1, 0, q.shape[2], spec.dv) and lse.shape == (1, q.shape[2], 0)
    out, lse = attn(q[:0], k[:0], v[:0])
    assert out.shape[0] == 0 and lse.shape[0] == 0
    torch.cuda.synchronize()


def test_rejects_cpu_tensors_and_bad_heads_before_launch():
    import torch

    spec = CASES["llama3-8b"]
    attn = fa4gen.compile(spec)
    q, k, v = _inputs(spec, 1, 8, 8, seed=1)
    with pytest.raises(ValueError, match="q is on cpu"):
        attn(q.cpu(), k.cpu(), v.cpu())
    with pytest.raises(ValueError, match="q heads"):
        attn(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="dtype"):
        attn(q.float(), k, v)
    torch.cuda.synchronize()


OPTION_CASES = plan_option_cases()


@pytest.mark.parametrize("shape", [(2, 1000, 1000), (1, 17, 700), (3, 700, 17)], ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(OPTION_CASES))
def test_plan_option_paths(name, shape):
    """Every plan option away from its default (serial schedule, ping-pong, persistence, O
    staging, warpgroup count) still matches the reference."""
    import torch

    spec, kernel_plan = OPTION_CASES[name]
    attn = fa4gen.compile(spec, kernel_plan=kernel_plan)
    assert attn.plan == kernel_plan
    q, k, v = _inputs(spec, *shape, seed=11)
    out = torch.full((shape[0], shape[1], q.shape[2], spec.dv), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((shape[0], q.shape[2], shape[1]), float("nan"), device="cuda", dtype=torch.float32)
    attn(q, k, v, out=out, lse=lse)
    torch.cuda.synchronize()
    assert_close_to_reference(spec, q, k, v, out, lse)
