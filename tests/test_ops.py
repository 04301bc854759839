"""The custom op ``torch.ops.fa4gen.forward`` and lazy builds, without a GPU.

The op's real implementation runs whatever its handle names: here a CPU runner computing
fa4gen's fp32 reference, so arguments are checked end to end through torch.compile
(Dynamo + AOTAutograd) on CPU tensors, and tracing is checked on meta tensors with symbolic
shapes (what torch.compile sees on the GPU). The kernels themselves run in tests/test_gpu_ops.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import fa4gen
import fa4gen.api as api
from fa4gen import custom_op, ops
from fa4gen.runtime import AttentionKernel
from fa4gen.testing import reference

SINKS_EXPR = fa4gen.AttentionSpec(
    head_dim=64,
    qhead_per_kvhead=2,
    causal=True,
    window_left=40,
    sinks=True,
    return_lse=True,
    aux={"bias": {"dtype": "float32", "shape": ["Hq"]}},
    scalars={"scale2": "float32", "shift": "int32"},
    score_mod={"kind": "expression", "expr": "score * scale2 + bias[h] + shift"},
)
DOCUMENTS = fa4gen.AttentionSpec(head_dim=64, mask="document", causal=True)


class ReferenceRunner:
    """Stands in for a compiled kernel: fa4gen's reference on CPU, recording each call."""

    def __init__(self, spec):
        self.spec, self.calls = spec, []

    def __call__(self, q, k, v, *, out=None, lse=None, **variant):
        self.calls.append(variant)
        args = {name: value for name, value in variant.items() if name != "aux"}
        args.update(variant.get("aux", {}))
        result, result_lse = reference(self.spec, q, k, v, args=args)
        result = result.to(q.dtype) if out is None else out.copy_(result)
        result_lse = result_lse if lse is None else lse.copy_(result_lse)
        return (result, result_lse) if self.spec.return_lse else result


@pytest.fixture
def reference_kernels(monkeypatch):
    runners = {}

    def kernel(spec):
        return runners.setdefault(spec.canonical_json(), ReferenceRunner(spec))

    monkeypatch.setattr(ops, "_kernel", kernel)
    return runners


def _inputs(batch, seqlen_q, seqlen_k, spec, kv_heads=2, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        if device == "meta":
            return torch.empty(*shape, device="meta", dtype=torch.bfloat16)
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    heads_q = kv_heads * spec.qhead_per_kvhead
    return (
        randn(batch, seqlen_q, heads_q, spec.head_dim),
        randn(batch, seqlen_k, kv_heads, spec.head_dim),
        randn(batch, seqlen_k, kv_heads, spec.dv),
    )


def test_op_is_registered_with_a_schema_autograd_can_use():
    schema = str(torch.ops.fa4gen.forward.default._schema)
    assert schema.startswith("fa4gen::forward(Tensor q, Tensor k, Tensor v, str kernel")
    assert schema.endswith("-> (Tensor, Tensor)")  # (out, lse) whatever the spec: what a backward saves
    assert "SymInt? max_seqlen_q" in schema  # symbolic under dynamic shapes


def test_opcheck_on_cpu(reference_kernels):
    """torch's own checks of a custom op: schema, fake implementation against the real one,
    AOTAutograd's dispatch."""
    q, k, v = _inputs(3, 37, 53, SINKS_EXPR)
    args = custom_op._op_arguments(
        ops.spec_handle(SINKS_EXPR),
        {"sinks": torch.randn(4), "aux": {"bias": torch.randn(4), "scale2": 0.5, "shift": 2}},
    )
    torch.library.opcheck(torch.ops.fa4gen.forward.default, (q, k, v, *args))


def test_arguments_reach_the_kernel_through_torch_compile(reference_kernels):
    """Sinks, aux tensors, float and int scalars pass through the op (Dynamo + AOTAutograd)
    unchanged: the compiled result is the reference's, with the int32 scalar an int again."""
    sinks, bias = torch.randn(4), torch.randn(4)

    def attend(q, k, v):
        return ops.attention(SINKS_EXPR, q, k, v, sinks=sinks, aux={"bias": bias, "scale2": 0.5, "shift": 2})

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    q, k, v = _inputs(3, 37, 53, SINKS_EXPR)
    out, lse = compiled(q, k, v)
    want_out, want_lse = reference(SINKS_EXPR, q, k, v, args={"sinks": sinks, "bias": bias, "scale2": 0.5, "shift": 2})
    torch.testing.assert_close(out, want_out.to(out.dtype))
    torch.testing.assert_close(lse, want_lse)
    (call,) = reference_kernels[SINKS_EXPR.canonical_json()].calls
    assert call["aux"]["shift"] == 2 and isinstance(call["aux"]["shift"], int)
    assert call["aux"]["scale2"] == 0.5 and call["sinks"] is not None


def test_cache_lengths_through_torch_compile(reference_kernels):
    """``seqused_k`` (per-entry KV cache lengths, the decode kernel's) passes through the op under
    torch.compile(fullgraph) and opcheck: the result is the reference's with each entry's keys
    ending at its own length, causal aligned to it."""
    lengths = torch.tensor([53, 0, 20], dtype=torch.int32)

    def attend(q, k, v):
        return ops.attention(SINKS_EXPR, q, k, v, sinks=sinks, seqused_k=lengths, aux=aux)

    sinks, aux = torch.randn(4), {"bias": torch.randn(4), "scale2": 0.5, "shift": 2}
    q, k, v = _inputs(3, 4, 53, SINKS_EXPR)
    out, lse = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v)
    args = {"sinks": sinks, "seqused_k": lengths, **aux}
    want_out, want_lse = reference(SINKS_EXPR, q, k, v, args=args)
    torch.testing.assert_close(out, want_out.to(out.dtype))
    torch.testing.assert_close(lse, want_lse)
    assert torch.equal(reference_kernels[SINKS_EXPR.canonical_json()].calls[0]["seqused_k"], lengths)
    op_args = custom_op._op_arguments(ops.spec_handle(SINKS_EXPR), {"sinks": sinks, "seqused_k": lengths, "aux": aux})
    torch.library.opcheck(torch.ops.fa4gen.forward.default, (q, k, v, *op_args))


def test_packed_documents_through_the_op(reference_kernels):
    total = 90
    cu = torch.tensor([0, 20, 61, 90], dtype=torch.int32)
    q, k, v = (t.squeeze(0) for t in _inputs(1, total, total, DOCUMENTS))
    compiled = torch.compile(
        lambda q, k, v: ops.attention(DOCUMENTS, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=41),
        fullgraph=True,
        backend="aot_eager",
    )
    out = compiled(q, k, v)
    assert out.shape == (total, 2, 64)
    (call,) = reference_kernels[DOCUMENTS.canonical_json()].calls
    assert call["max_seqlen_q"] == 41 and torch.equal(call["cu_seqlens_q"], cu)
    for start, end in ((0, 20), (20, 61), (61, 90)):  # each document attends within itself only
        one = DOCUMENTS.model_copy(update={"mask": None})
        want, _ = reference(one, q[None, start:end], k[None, start:end], v[None, start:end])
        torch.testing.assert_close(out[start:end], want[0].to(out.dtype))


def _counting_backend():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


@pytest.mark.parametrize("through", ["ops.attention", "AttentionKernel", "AttentionKernel, training"])
def test_one_graph_for_every_shape(through):
    """fullgraph with dynamic shapes on meta tensors (no data: only the fake implementation
    runs): one graph, holding one fa4gen.forward call, serves three batch sizes and sequence
    lengths with no recompile."""
    spec = SINKS_EXPR.model_copy(update={"aux": {}, "scalars": {}, "score_mod": None})
    kernel = AttentionKernel(spec, fa4gen.plan(spec, "sm_90a"), function=None)
    training = through.endswith("training")  # inputs that require grad: the op on the LSE kernel
    if training:  # (the spec returns its LSE: it is its own training forward)
        from fa4gen.backward import TrainingKernels

        kernels = TrainingKernels(spec, kernel, lambda: None)
        kernel.training = lambda: kernels
    sinks = torch.empty(8, device="meta")

    def attend(q, k, v):
        if through.startswith("AttentionKernel"):
            return kernel(q, k, v, sinks=sinks)
        return ops.attention(spec, q, k, v, sinks=sinks)

    graphs, backend = _counting_backend()
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend=backend)
    for batch, seqlen_q, seqlen_k in ((3, 100, 300), (5, 17, 33), (7, 1000, 1000)):
        q, k, v = (t.requires_grad_(training) for t in _inputs(batch, seqlen_q, seqlen_k, spec, 4, "meta"))
        out, lse = compiled(q, k, v)
        assert out.shape == (batch, seqlen_q, 8, 64) and lse.shape == (batch, 8, seqlen_q)
    assert len(graphs) == 1
    op = torch.ops.fa4gen.forward
    calls = [n for n in graphs[0].graph.nodes if n.target in (op, op.default)]
    assert len(calls) == 1
    inputs = (t.requires_grad_(training) for t in _inputs(2, 9, 11, spec, kv_heads=4, device="meta"))
    explained = torch._dynamo.explain(attend)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_fake_implementation_checks_the_layout(reference_kernels):
    q, k, v = _inputs(2, 8, 8, DOCUMENTS, device="meta")  # 4-dim: not the packed layout
    with pytest.raises(ValueError, match=r"q must be \(total_tokens, heads, head_dim\)"):
        ops.attention(DOCUMENTS, q, k, v)


def test_an_unknown_handle_is_one_clear_error():
    q, k, v = _inputs(1, 4, 4, DOCUMENTS)
    args = custom_op._op_arguments("kernel-0000", {})
    with pytest.raises(ValueError, match="no fa4gen kernel is registered as 'kernel-0000'"):
        torch.ops.fa4gen.forward(q, k, v, *args)


def test_given_buffers_and_unknown_keywords(reference_kernels):
    spec = DOCUMENTS.model_copy(update={"mask": None})
    q, k, v = _inputs(2, 8, 8, spec)
    out = torch.full((2, 8, 2, 64), float("nan"), dtype=torch.bfloat16)
    handle = ops.spec_handle(spec)
    assert custom_op.call(handle, spec, q, k, v, out=out) is out and not out.isnan().any()
    with pytest.raises(ValueError, match="without return_lse"):
        custom_op.call(handle, spec, q, k, v, lse=torch.empty(2, 2, 8))
    with pytest.raises(TypeError, match="unexpected keyword arguments: windw"):
        ops.attention(spec, q, k, v, windw=3)


# ----------------------------------------------------------------------------- lazy builds
def test_compile_builds_only_what_a_call_runs(monkeypatch, tmp_path):
    """On a cache miss fa4gen.compile builds nothing; a launch builds the kernel of its length
    range only; prepare() builds the rest; no_compile refuses at once."""
    built = []

    def fake_build(spec, target, kernel_plan, cache, no_compile, progress=None, label="given"):
        built.append(kernel_plan)
        entry = type("Entry", (), {"path": tmp_path / f"k{len(built)}", "meta": {}})()
        return api.BuildResult(spec=spec, plan=kernel_plan, key="0" * 64, entry=entry, built_now=True)

    monkeypatch.setattr(api, "_build_plan", fake_build)
    monkeypatch.setattr(api, "load_function", lambda path, cuda: f"function of {path.name}")
    monkeypatch.setattr(api, "_tuned_for_this_device", lambda *args: None)
    spec = fa4gen.AttentionSpec(head_dim=64)  # the planner has short and long ranges for it
    kernel = fa4gen.compile(spec, arch="sm_90a", cache_dir=tmp_path / "cache")
    labels = [split.split.label for split in kernel.splits]
    assert labels == ["decode", "short", "long", "decode-wide", "paged", "paged-wide"] and built == []
    assert not kernel.built and not any(split.kernel.built for split in kernel.splits)

    short = kernel.kernel_for(512)
    assert short._loaded_function() == "function of k1" and built == [short.plan]
    assert short.built and not kernel.built
    assert kernel.prepare() is kernel and len(built) == 7 and kernel.built
    assert fa4gen.compile(spec, arch="sm_90a", cache_dir=tmp_path / "cache") is kernel  # memoised, built
    with pytest.raises(fa4gen.CacheMiss, match="no cached kernel"):
        fa4gen.compile(spec.model_copy(update={"causal": True}), arch="sm_90a", cache_dir=tmp_path, no_compile=True)


def test_the_op_is_imported_only_when_a_call_is_traced():
    """Making a kernel (fa4gen.compile on a cache hit) registers its name without importing the
    custom op (torch.library registration costs start-up time); the first traced call imports it,
    inside Dynamo's trace, and still gives one graph with no break."""
    import subprocess
    import sys

    script = """
import sys, torch, fa4gen
from fa4gen.runtime import AttentionKernel
spec = fa4gen.AttentionSpec(head_dim=64)
kernel = AttentionKernel(spec, fa4gen.plan(spec, "sm_90a"), function=None)
assert "fa4gen.custom_op" not in sys.modules
graphs = []
def backend(gm, inputs):
    graphs.append(gm)
    return gm.forward
q = torch.empty(3, 10, 2, 64, device="meta", dtype=torch.bfloat16)
out = torch.compile(lambda q: kernel(q, q, q), fullgraph=True, backend=backend)(q)
assert out.shape == (3, 10, 2, 64) and len(graphs) == 1 and "fa4gen.custom_op" in sys.modules
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_eager_calls_launch_directly_and_traced_ones_use_the_op(reference_kernels, monkeypatch):
    """Run eagerly, ``ops.attention`` calls the kernel itself (no dispatcher per decode step);
    with tensors that hold no data (meta / fake) it is the op, so tracing sees one node."""
    spec = DOCUMENTS.model_copy(update={"mask": None})
    through_op = []
    monkeypatch.setattr(ops, "call", lambda *args, **kwargs: through_op.append(args) or "op")
    q, k, v = _inputs(2, 8, 8, spec)
    out = torch.full((2, 8, 2, 64), float("nan"), dtype=torch.bfloat16)
    assert ops.attention(spec, q, k, v, out=out) is out and not out.isnan().any() and through_op == []
    (runner,) = reference_kernels.values()
    assert runner.calls == [{}]
    assert ops.attention(spec, *_inputs(2, 8, 8, spec, device="meta")) == "op" and len(through_op) == 1
    with pytest.raises(TypeError, match="unexpected keyword arguments: windw"):
        ops.attention(spec, q, k, v, windw=3)


class ReferenceBackward:
    """Stands in for a compiled backward: autograd of fa4gen's fp32 reference on CPU."""

    def __init__(self, spec):
        self.spec, self.calls = spec, 0

    def __call__(self, q, k, v, out, dout, lse, dlse=None, **variant):
        from fa4gen.testing import reference_gradients
        from fa4gen.variants import lower

        self.calls += 1
        if lower(self.spec).trainable:
            # autograd of the reference gives the tensors' gradients too; on a thread of its own,
            # since the op's implementation runs with autograd's dispatch keys excluded (per thread)
            with ThreadPoolExecutor(1) as pool:
                grads = pool.submit(reference_gradients, self.spec, q, k, v, dout, dlse=dlse, args=variant).result()
            return tuple(g.to(q.dtype) if i < 3 else g for i, g in enumerate(grads))
        grads = closed_form_gradients(self.spec, q, k, v, dout, dlse, variant.get("sinks"))
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v, variant.get("sinks")), strict=False))


def closed_form_gradients(spec, q, k, v, dout, dlse=None, sinks=None):
    """dq, dk, dv of softmax attention written out (no autograd: a custom op's implementation runs
    where autograd records nothing), fp32: dP = dO.V^T, dS = P * (dP - rowsum(dO * O) + dLSE),
    times tanh's derivative under a soft cap, dQ = scale * dS.K, dK = scale * dS^T.Q, dV = P^T.dO,
    dK and dV summed over each KV head's query heads."""
    from fa4gen.testing import visible_mask

    group = spec.qhead_per_kvhead
    qh, do = q.float().transpose(1, 2), dout.float().transpose(1, 2)
    kh = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = qh @ kh.transpose(-1, -2) * spec.scale
    slope = torch.ones_like(scores)
    if spec.softcap is not None:
        t = torch.tanh(scores / spec.softcap)
        scores, slope = spec.softcap * t, 1 - t * t
    visible = visible_mask(spec, q.shape[1], k.shape[1], device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    sink_probs = probs[..., -1] if sinks is not None else None
    probs = probs[..., : kh.shape[2]]
    out = probs @ vh
    dp = do @ vh.transpose(-1, -2)
    rowsum = (do * out).sum(-1, keepdim=True)
    if dlse is not None:
        rowsum = rowsum - dlse.float().unsqueeze(-1)
    ds = probs * (dp - rowsum) * slope
    dq = spec.scale * ds @ kh
    dk = spec.scale * ds.transpose(-1, -2) @ qh
    dv = probs.transpose(-1, -2) @ do

    def per_kv_head(t):
        b, h, s, d = t.shape
        return t.view(b, h // group, group, s, d).sum(2)

    grads = (dq.transpose(1, 2), per_kv_head(dk).transpose(1, 2), per_kv_head(dv).transpose(1, 2))
    if sinks is None:
        return grads
    return (*grads, -(sink_probs * rowsum.squeeze(-1)).sum(dim=(0, 2)))


@pytest.fixture
def reference_training(reference_kernels, monkeypatch):
    backwards = {}

    def backward(spec):
        return backwards.setdefault(spec.canonical_json(), ReferenceBackward(spec))

    monkeypatch.setattr(ops, "_backward", backward)
    return backwards


@pytest.mark.parametrize(
    "spec",
    [
        fa4gen.AttentionSpec(head_dim=64, qhead_per_kvhead=2, causal=True),
        fa4gen.AttentionSpec(head_dim=32, window_left=5, return_lse=True),
        fa4gen.AttentionSpec(head_dim=32, qhead_per_kvhead=2, causal=True, window_left=7, sinks=True),
    ],
    ids=["causal-gqa2", "window-lse", "window-sinks"],
)
def test_training_through_torch_compile(reference_training, spec):
    """fullgraph torch.compile of a training step: the op's autograd formula saves out and the LSE
    (the forward runs the spec with its LSE) and calls the backward op; the gradients are the
    reference's, and the trace has one graph without breaks."""
    from fa4gen.testing import reference_gradients

    q, k, v = _inputs(2, 19, 23, spec, seed=3)
    dout = torch.randn(2, 19, q.shape[2], spec.dv).to(torch.bfloat16)
    sinks = torch.randn(q.shape[2]).requires_grad_() if spec.sinks else None
    variant = {"sinks": sinks} if spec.sinks else {}

    def step(q, k, v):
        result = ops.attention(spec, q, k, v, **variant)
        out = result[0] if spec.return_lse else result
        loss = (out.float() * dout.float()).sum()
        return loss + result[1].sum() if spec.return_lse else loss

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    dlse = torch.ones(2, q.shape[2], 19) if spec.return_lse else None
    want = reference_gradients(spec, q, k, v, dout, dlse=dlse, args=variant)
    got = [t.grad for t in leaves] + ([sinks.grad] if spec.sinks else [])
    for found, expected in zip(got, want, strict=True):
        torch.testing.assert_close(found.float(), expected, atol=2e-2, rtol=2e-2)
    # the written-out gradients agree with autograd of the reference (so the stand-in is right)
    closed = closed_form_gradients(spec, q, k, v, dout, dlse, sinks.detach() if spec.sinks else None)
    for found, expected in zip(closed, want, strict=True):
        torch.testing.assert_close(found, expected, atol=1e-4, rtol=1e-4)
    (backward,) = reference_training.values()
    assert backward.calls == 1
    explained = torch._dynamo.explain(step)(*[t.clone().requires_grad_() for t in (q, k, v)])
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_the_backward_op_is_registered_with_its_fake():
    schema = str(torch.ops.fa4gen.backward.default._schema)
    assert schema.startswith("fa4gen::backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse")
    from fa4gen.handles import register

    spec = fa4gen.AttentionSpec(
        head_dim=16, score_mod={"kind": "relative_bias", "max_distance": 3, "requires_grad": True}
    )
    handle = register("test-backward-fake", spec, lambda: None)
    q, k, v = _inputs(1, 5, 7, spec, device="meta")
    lse = q.new_empty(1, 2, 5).float()
    table = torch.empty(2, 7, device="meta")
    dq, dk, dv, dsinks, trained = torch.ops.fa4gen.backward(
        q, k, v, q, q, lse, None, handle, None, None, table, None, None, None, "", [], "", []
    )
    assert dsinks.shape == (0,) and [t.shape for t in trained] == [table.shape]  # the table's gradient
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_the_backward_op_takes_the_forward_arguments_it_names():
    """Autograd hands the backward op the forward op's arguments at _BACKWARD_ARGUMENTS: each is
    the forward's argument of the backward's parameter name (prefix lengths and cu_seqlens
    included, so prefix-LM and documents train through the op)."""
    from fa4gen.custom_op import _BACKWARD_ARGUMENTS

    forward = [a.name for a in torch.ops.fa4gen.forward.default._schema.arguments]
    backward = [a.name for a in torch.ops.fa4gen.backward.default._schema.arguments]
    assert [forward[i] for i in _BACKWARD_ARGUMENTS] == backward[7:]


TRAINED = fa4gen.AttentionSpec(
    head_dim=32,
    qhead_per_kvhead=2,
    causal=True,
    score_mod={
        "kind": "expression",
        "expr": "score * temperature[h] * gain + table[h, max(min(q_idx - kv_idx, 7), 0)]",
    },
    scalars={"gain": "float32", "unused": "int32"},  # (scalars: a list of numbers in the op, one leaf to autograd)
    aux={
        "temperature": {"dtype": "float32", "shape": ["Hq"], "requires_grad": True},
        "table": {"dtype": "float32", "shape": ["Hq", 8], "requires_grad": True},
    },
)


@pytest.mark.parametrize(
    "spec",
    [
        TRAINED,
        fa4gen.AttentionSpec(
            head_dim=32, score_mod={"kind": "relative_bias", "max_distance": 6, "requires_grad": True}
        ),
    ],
    ids=["aux", "rel-bias"],
)
def test_trainable_tensors_get_their_gradients_through_the_op(reference_training, spec):
    """Tensors the spec trains come back from the backward op and land in their .grad (aux
    tensors by name, the relative-bias table by keyword), also under fullgraph torch.compile."""
    from fa4gen.testing import reference_gradients

    torch._dynamo.reset()  # (each case compiles its own step: no recompile of the one before)
    q, k, v = _inputs(2, 13, 13, spec, seed=5)
    heads = q.shape[2]
    dout = torch.randn(2, 13, heads, spec.dv).to(torch.bfloat16)
    if spec.aux:
        trained = {"temperature": torch.rand(heads) + 0.5, "table": torch.randn(heads, 8)}
        variant = {"aux": {name: t.clone().requires_grad_() for name, t in trained.items()}}
        variant["aux"].update(gain=0.75, unused=3)
        leaves_of = lambda given: [given["aux"][name] for name in sorted(trained)]  # noqa: E731
    else:
        variant = {"rel_bias": torch.randn(heads, 13).requires_grad_()}
        leaves_of = lambda given: [given["rel_bias"]]  # noqa: E731

    def step(q, k, v):
        return (ops.attention(spec, q, k, v, **variant).float() * dout.float()).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves).backward()
    want = reference_gradients(spec, q, k, v, dout, args=variant)
    got = [t.grad for t in leaves] + [t.grad for t in leaves_of(variant)]
    assert len(got) == len(want) == 3 + len(leaves_of(variant))
    for found, expected in zip(got, want, strict=True):
        torch.testing.assert_close(found.float(), expected, atol=2e-2, rtol=2e-2)
    assert all(t.grad.abs().sum() > 0 for t in leaves_of(variant))


def test_a_tensor_the_spec_does_not_train_may_not_require_grad(reference_training):
    spec = fa4gen.AttentionSpec(head_dim=32, score_mod={"kind": "relative_bias", "max_distance": 6})
    q, k, v = (t.requires_grad_() for t in _inputs(1, 5, 5, spec))
    kernel = AttentionKernel(spec, fa4gen.plan(spec), function=None)
    kernel.training = lambda: None
    with pytest.raises(ValueError, match="rel_bias= requires grad, but the spec does not train it"):
        kernel(q, k, v, rel_bias=torch.randn(2, 13).requires_grad_())
