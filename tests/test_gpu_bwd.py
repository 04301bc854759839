"""The backward against fp32 autograd of the reference on the GPU (marker `gpu`; skipped without one).

Kernels come from the cache (warmed by ``tests/warm_gpu_cache.py``). Gradient buffers are
poisoned with NaN before each launch, inputs and output gradients are fresh random normals, and
the bound is 2x PyTorch's own error: autograd of the reference in the inputs' dtype against
float32, or of the error that reading the stored (bf16) output alone causes where that is larger
(fa4gen.testing.assert_gradients_close; checked on the CPU in test_reference_bounds.py).
"""

from __future__ import annotations

import pytest
from gpu_cases import (
    AUTOGRAD_CASES,
    BACKWARD_SHAPES,
    DETERMINISTIC_CASES,
    backward_specs,
    grouped_turns_plan,
    transposed_plan,
    transposed_specs,
    variant_inputs,
)

import fa4gen
from fa4gen.api import training_spec
from fa4gen.testing import assert_gradients_close
from fa4gen.variants import lower

pytestmark = pytest.mark.gpu

CASES = backward_specs()
KV_HEADS = 2


def _inputs(spec, batch: int, seqlen_q: int, seqlen_k: int, seed: int):
    """q, k, v, the output's gradient and the variant's run-time values (gpu_cases.variant_inputs)."""
    import torch

    q, k, v, args = variant_inputs(spec, batch, seqlen_q, seqlen_k, seed, kv_heads=KV_HEADS)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    dout = torch.randn(*q.shape[:-1], spec.dv, generator=gen, device="cuda").to(q.dtype)
    return q, k, v, dout, args


def _backward_matches_reference(spec, shape, seed: int, plan=None):
    """The backward (``plan``, else the planner's) on the training forward's out and LSE, into
    NaN-filled gradients it must return, against the reference; (the backward, the call's
    tensors, the variant's values, the gradients)."""
    import torch

    q, k, v, dout, args = _inputs(spec, *shape, seed=seed)
    out, lse = fa4gen.compile(training_spec(spec))(q, k, v, **args)
    dlse = torch.randn(lse.shape, device="cuda", dtype=torch.float32) if spec.return_lse else None
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    backward = fa4gen.compile_backward(spec, kernel_plan=plan)
    result = backward(q, k, v, out, dout, lse, dlse, dq=grads[0], dk=grads[1], dv=grads[2], **args)
    assert all(got is given for got, given in zip(result, grads))
    torch.cuda.synchronize()
    assert_gradients_close(spec, q, k, v, dout, result, dlse=dlse, args=args)
    return backward, (q, k, v, out, dout, lse, dlse), args, result


@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_matches_reference(name, shape):
    """The backward kernel on the training forward's out and LSE, into NaN-filled gradients."""
    _backward_matches_reference(CASES[name], shape, seed=hash((name, shape)) % 2**31)


@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=lambda s: "b{}-sq{}-sk{}".format(*s))
@pytest.mark.parametrize("name", sorted(transposed_specs()))
def test_transposed_backward_matches_reference(name, shape):
    """The backward computed transposed (dkv_split t: 96-key tiles, dK^T and dV^T with keys on the
    MMA's N side) on the training forward's out and LSE, into NaN-filled gradients; deterministic
    cases give the same bits twice."""
    import torch

    spec = transposed_specs()[name]
    seed = hash((name, shape, "t")) % 2**31
    backward, tensors, args, result = _backward_matches_reference(spec, shape, seed, transposed_plan(spec))
    assert backward.plan.config.dkv_split == "t"
    if spec.deterministic:
        again = backward(*tensors, **args)
        assert all(torch.equal(a, b) for a, b in zip(again, result))


@pytest.mark.parametrize("name", AUTOGRAD_CASES)
def test_autograd(name):
    """loss.backward() through fa4gen.compile(spec): the gradients autograd leaves in .grad,
    with dout made non-contiguous by the loss (the backward takes any strides)."""
    import torch

    spec = CASES[name]
    q, k, v, dout, args = _inputs(spec, 2, 333, 555, seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if spec.sinks:  # the sink logits train too
        leaves.append(args["sinks"].clone().requires_grad_())
        args = {**args, "sinks": leaves[3]}
    args = {**args, "aux": dict(args.get("aux") or {})}
    for extra in lower(spec).trainable:  # and the tensors the spec trains
        holder, key = (args["aux"], extra.name) if extra.role == "aux" else (args, extra.role)
        holder[key] = holder[key].clone().requires_grad_()
        leaves.append(holder[key])
    result = fa4gen.compile(spec)(*leaves[:3], **args)
    out = result[0] if spec.return_lse else result
    loss = (out.float() * dout.float().transpose(1, 2).contiguous().transpose(1, 2)).sum()
    if spec.return_lse:
        loss = loss + result[1].sum()
    loss.backward()
    dlse = torch.ones_like(result[1]) if spec.return_lse else None
    assert_gradients_close(spec, q, k, v, dout, [t.grad for t in leaves], dlse=dlse, args=args)


def test_deterministic_dk_dv():
    """dK and dV are written once per key tile (no cross-CTA sum): bit-identical run to run."""
    import torch

    spec = CASES["d128-gqa4-causal"]
    q, k, v, dout, _ = _inputs(spec, 2, 1000, 1000, seed=11)
    out, lse = fa4gen.compile(training_spec(spec))(q, k, v)
    backward = fa4gen.compile_backward(spec)
    first = backward(q, k, v, out, dout, lse)
    for _ in range(4):
        again = backward(q, k, v, out, dout, lse)
        assert torch.equal(again[1], first[1]) and torch.equal(again[2], first[2])


@pytest.mark.parametrize("name", ["d128-gqa4-causal", "d256-gqa4-causal"])
def test_heaviest_key_tiles_first_matches_the_reference(name):
    """A causal GQA backward with one to eight CTAs per SM launches key tile 0 of every (KV head,
    batch) first (fa4gen.backward.key_tile_order): its gradients against the reference on such a
    shape, into NaN-filled buffers."""
    import torch

    from fa4gen.backward import head_splits, key_tile_order
    from fa4gen.kernels.sm90.bwd_config import KeyTileOrder
    from fa4gen.runtime import multiprocessor_count

    spec = CASES[name]
    q, k, v, dout, args = _inputs(spec, 4, 2048, 2048, seed=23)
    backward = fa4gen.compile_backward(spec)
    sms = multiprocessor_count(q.device)
    splits = head_splits(backward.plan, 4, KV_HEADS, 2048, sms)
    assert key_tile_order(backward.plan, 4, KV_HEADS * splits, 2048, sms) == KeyTileOrder.OUTERMOST
    out, lse = fa4gen.compile(training_spec(spec))(q, k, v, **args)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    result = backward(q, k, v, out, dout, lse, dq=grads[0], dk=grads[1], dv=grads[2], **args)
    torch.cuda.synchronize()
    assert_gradients_close(spec, q, k, v, dout, result, args=args)


@pytest.mark.parametrize(
    "shape",
    [(2, 1000, 1000), (4, 4096, 4096), (1, 300, 2000), (1, 300, 17000)],
    ids=lambda s: "b{}-sq{}-sk{}".format(*s),
)
@pytest.mark.parametrize("name", DETERMINISTIC_CASES)
def test_deterministic_mode_gives_the_same_bits_every_run(name, shape):
    """spec.deterministic: dQ, dK, dV (and the sinks' gradient) bit-identical over 5 runs, also
    with more CTAs than the GPU holds at once (B=4, S=4096) and with more key tiles than SMs
    (Sk=17000: 133 key tiles, launched highest first where turns descend)."""
    import torch

    spec = CASES[f"{name}-deterministic"]
    q, k, v, dout, args = _inputs(spec, *shape, seed=hash((name, shape)) % 2**31)
    out, lse = fa4gen.compile(training_spec(spec))(q, k, v, **args)
    backward = fa4gen.compile_backward(spec)
    first = backward(q, k, v, out, dout, lse, **args)
    for _ in range(4):
        again = backward(q, k, v, out, dout, lse, **args)
        for name_, a, b in zip(("dq", "dk", "dv", "dsinks"), again, first):
            assert torch.equal(a, b), name_
    if shape[0] == 2:  # and still the reference's gradients
        assert_gradients_close(spec, q, k, v, dout, first, args=args)


@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("name", DETERMINISTIC_CASES)
def test_deterministic_dq_groups_sum_in_a_fixed_order(name, groups, monkeypatch):
    """dq_grouped_turns: dQ's turns dealt over 1, 3 or 8 partial accumulators (the run-time count
    forced: 8 leaves some groups of a query tile empty): bit-identical over 3 runs, and the
    reference's gradients."""
    import torch

    import fa4gen.backward

    monkeypatch.setattr(fa4gen.backward, "dq_groups", lambda plan, seqlen_k: groups)
    spec = CASES[f"{name}-deterministic"]
    q, k, v, dout, args = _inputs(spec, 2, 1000, 1500, seed=hash((name, groups)) % 2**31)
    out, lse = fa4gen.compile(training_spec(spec))(q, k, v, **args)
    backward = fa4gen.compile_backward(spec, kernel_plan=grouped_turns_plan(spec))
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    first = backward(q, k, v, out, dout, lse, dq=grads[0], dk=grads[1], dv=grads[2], **args)
    first = [t.clone() for t in first]
    for _ in range(2):
        again = backward(q, k, v, out, dout, lse, **args)
        for name_, a, b in zip(("dq", "dk", "dv", "dsinks"), again, first):
            assert torch.equal(a, b), name_
    assert_gradients_close(spec, q, k, v, dout, first, args=args)


def test_training_step_under_torch_compile_and_in_a_cuda_graph():
    """A training step (forward, loss, backward) traced whole by torch.compile(fullgraph=True),
    and captured in a CUDA graph and replayed on new inputs: the gradients are the reference's."""
    import torch

    spec = CASES["d128-gqa4-causal"]
    kernel = fa4gen.compile(spec)
    q, k, v, dout, _ = _inputs(spec, 2, 257, 257, seed=5)

    def step(q, k, v):
        return (kernel(q, k, v).float() * dout.float()).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(step, fullgraph=True)(*leaves).backward()
    assert_gradients_close(spec, q, k, v, dout, [t.grad for t in leaves])

    static = [t.clone().requires_grad_() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture: kernels load, workspaces allocate
        step(*static).backward()
    torch.cuda.current_stream().wait_stream(side)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*static).backward()
    fresh = _inputs(spec, 2, 257, 257, seed=6)[:3]
    with torch.no_grad():
        for t, new in zip(static, fresh, strict=True):
            t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert_gradients_close(spec, *fresh, dout, [t.grad for t in static])


def test_a_small_transformer_trains_as_it_does_with_sdpa():
    """examples/training.py's 300 steps of a 2-layer causal transformer (8 query heads over 2 KV
    heads, d64), once with fa4gen's attention and once with SDPA, from the same weights and
    batches: both learn, and the loss curves agree within bf16 noise (20-step means within 5%, or
    0.02 once the loss is near 0). FA4GEN_TRAINING_CURVES=path writes both curves."""
    import importlib.util
    import json
    import os
    from pathlib import Path

    import torch

    path = Path(__file__).resolve().parent.parent / "examples" / "training.py"
    module_spec = importlib.util.spec_from_file_location("training_example", path)
    example = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(example)
    curves = {"fa4gen": example.train(fa4gen.compile(example.SPEC)), "sdpa": example.train(example.sdpa)}
    if os.environ.get("FA4GEN_TRAINING_CURVES"):
        with open(os.environ["FA4GEN_TRAINING_CURVES"], "w") as handle:
            json.dump(curves, handle)
    mine, theirs = (torch.tensor(curves[name]) for name in ("fa4gen", "sdpa"))
    assert mine[-20:].mean() < 0.5 * mine[:20].mean(), "fa4gen's run did not learn"
    ours, reference = mine.view(-1, 20).mean(1), theirs.view(-1, 20).mean(1)
    excess = ((ours - reference).abs() - (0.05 * reference + 0.02)).max().item()
    assert excess <= 0, f"20-step mean losses differ: fa4gen {ours.tolist()}, SDPA {reference.tolist()}"


def test_backward_refuses_bad_arguments_in_one_line():
    """A wrong gradient, LSE, buffer or keyword raises before any launch, naming the argument."""
    import torch

    spec = CASES["d128-gqa4-causal"]
    q, k, v, dout, _ = _inputs(spec, 2, 100, 100, seed=3)
    out, lse = fa4gen.compile(training_spec(spec))(q, k, v)
    backward = fa4gen.compile_backward(spec)
    bad = {
        "dout": lambda: backward(q, k, v, out, dout.float(), lse),
        "lse": lambda: backward(q, k, v, out, dout, lse[:, :, :50]),
        "dlse": lambda: backward(q, k, v, out, dout, lse, torch.zeros(3, device="cuda")),
        "dq": lambda: backward(q, k, v, out, dout, lse, dq=torch.empty_like(k)),
        "out": lambda: backward(q, k, v, out[:, :50], dout, lse),
        "sinks=": lambda: backward(q, k, v, out, dout, lse, sinks=torch.zeros(8, device="cuda")),
    }
    for name, call in bad.items():
        with pytest.raises(ValueError, match=name) as error:
            call()
        assert "\n" not in str(error.value), name
    with pytest.raises(TypeError, match="bias"):
        backward(q, k, v, out, dout, lse, bias=1)
    # a transposed gradient (as autograd may hand it) is taken as it is
    grads = backward(q, k, v, out, dout.transpose(1, 2).contiguous().transpose(1, 2), lse)
    assert_gradients_close(spec, q, k, v, dout, grads)
