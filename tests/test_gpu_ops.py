"""The custom op on the GPU: torch.compile (fullgraph, dynamic shapes, Inductor), CUDA graphs
and ``fa4gen.ops.attention``, each against the eager kernel (marker `gpu`).

Kernels come from the warmed cache (tests/warm_gpu_cache.py): specs/ as gpu_cases names them.
"""

from __future__ import annotations

import pytest
from gpu_cases import gpu_specs, variant_inputs

import fa4gen

pytestmark = pytest.mark.gpu

KV_HEADS = 2


def _spec(name: str) -> fa4gen.AttentionSpec:
    return gpu_specs()[name]


def _fresh(spec, batch, seqlen, seed):
    q, k, v, args = variant_inputs(spec, batch, seqlen, seqlen, seed=seed, kv_heads=KV_HEADS)
    return q, k, v, args


@pytest.mark.parametrize("name", ["llama3-8b", "gpt-oss-sinks+lse", "phi3-mini+lse"])
def test_compiled_fullgraph_dynamic_matches_eager(name):
    """torch.compile(fullgraph=True, dynamic=True) with Inductor: one graph for three batch sizes
    and sequence lengths (across phi3-mini's length ranges: the kernel picks its plan at run
    time), no graph break, and the eager kernel's result."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    spec = _spec(name)
    attn = fa4gen.compile(spec)

    def block(q, k, v, args):
        result = attn(q * 1.0, k, v, **args)  # an op of torch's own on either side of the kernel
        out = result[0] if spec.return_lse else result
        return out.float().sum(dim=-1)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for batch, seqlen in ((3, 777), (5, 130), (7, 4100)):
        q, k, v, args = _fresh(spec, batch, seqlen, seed=seqlen)
        want = block(q, k, v, args)
        got = compiled(q, k, v, args)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # (a split tail merges in any order)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles over three shapes"
    explained = torch._dynamo.explain(block)(*_fresh(spec, 2, 64, seed=1))
    assert explained.graph_break_count == 0


def test_cuda_graph_replays_the_kernel():
    """A CUDA graph captured around an eager call replays on new inputs copied into the captured
    buffers (and a persistent kernel's split workspace is fine across replays)."""
    import torch

    spec = _spec("phi3-mini+lse")
    attn = fa4gen.compile(spec)
    q, k, v, args = _fresh(spec, 2, 4100, seed=3)  # long: phi3's split-tail kernel runs
    attn(q, k, v, **args)  # warm-up on the side stream the capture uses
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attn(q, k, v, **args)
    for seed in (4, 5):
        q2, k2, v2, _ = _fresh(spec, 2, 4100, seed=seed)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        out.fill_(float("nan"))
        graph.replay()
        want, want_lse = attn(q2, k2, v2, **args)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_reduce_overhead_mode_uses_cuda_graphs():
    """torch.compile(mode="reduce-overhead"): Inductor's CUDA graph trees around the op."""
    import torch

    spec = _spec("llama3-8b")
    attn = fa4gen.compile(spec)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attn(q, k, v) * 2.0, fullgraph=True, mode="reduce-overhead")
    for seed in (1, 2, 3):  # warm-up, record, replay
        q, k, v, _ = _fresh(spec, 2, 1000, seed=seed)
        got = compiled(q, k, v).clone()
        torch.testing.assert_close(got, attn(q, k, v) * 2.0, rtol=0, atol=0)


def test_ops_attention_runs_the_cached_kernel():
    """fa4gen.ops.attention (what model code calls) runs the same kernel as fa4gen.compile, from
    the warmed cache; compile() on a cache that has every kernel loads them all at once."""
    import torch

    from fa4gen import ops

    spec = _spec("gpt-oss-sinks+lse")
    attn = fa4gen.compile(spec)
    assert attn.built and all(split.kernel.built for split in attn.splits)
    q, k, v, args = _fresh(spec, 2, 300, seed=9)
    out, lse = ops.attention(spec, q, k, v, **args)
    want, want_lse = attn(q, k, v, **args)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
