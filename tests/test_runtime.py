"""The callable's argument checks (CPU: they all fire before any launch)."""

from __future__ import annotations

import pytest
import torch

import fa4gen
from fa4gen.runtime import AttentionKernel

SPEC = fa4gen.AttentionSpec(head_dim=64, head_dim_v=128, qhead_per_kvhead=2, causal=True)


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def kernel():
    return AttentionKernel(SPEC, fa4gen.plan(SPEC, "sm_90a"), Recorder())


def _qkv(b=2, sq=5, sk=7, hkv=3, dtype=torch.bfloat16):
    q = torch.randn(b, sq, hkv * 2, 64).to(dtype)
    k = torch.randn(b, sk, hkv, 64).to(dtype)
    v = torch.randn(b, sk, hkv, 128).to(dtype)
    return q, k, v


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, k, v: (q.float(), k, v), "q has dtype torch.float32"),
        (lambda q, k, v: (q, k.half(), v), "k has dtype torch.float16"),
        (lambda q, k, v: (q[0], k, v), "q must have 4 dims"),
        (lambda q, k, v: (q, k, v[..., :64]), "v has head dim 64, the spec needs 128"),
        (lambda q, k, v: (q[..., :32], k, v), "q has head dim 32"),
        (lambda q, k, v: (q, k, v[:1]), "batch sizes differ"),
        (lambda q, k, v: (q, k, v[:, :3]), "k and v must have the same seqlen"),
        (lambda q, k, v: (q, k[:, :, :2], v[:, :, :2]), "q heads"),
        (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), "contiguous in its last dim"),
        (lambda q, k, v: (q[:, :, :, 1:].contiguous()[..., :63], k, v), "head dim 63"),
        (lambda q, k, v: (q, k, v), "q is on cpu"),
        (lambda q, k, v: ("q", k, v), "q must be a torch.Tensor"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(kernel, mutate, message):
    q, k, v = mutate(*_qkv())
    with pytest.raises(ValueError, match=message):
        kernel(q, k, v)
    assert not kernel._function.calls


def test_misaligned_strides_rejected(kernel):
    q, k, v = _qkv()
    wide = torch.zeros(2, 5, 6, 68, dtype=torch.bfloat16)[..., :64]  # row stride 68: not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte aligned"):
        kernel(wide, k, v)


def test_lse_argument_needs_return_lse(kernel):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="without return_lse"):
        kernel(q, k, v, lse=torch.empty(1))


# --------------------------------------------------------------------------- variant arguments
from fa4gen.runtime import variant_arguments  # noqa: E402
from fa4gen.variants import standard_alibi_slopes  # noqa: E402


def _qk(batch=2, sq=16, sk=24, hq=4, hkv=2, d=64):
    return torch.randn(batch, sq, hq, d), torch.randn(batch, sk, hkv, d)


def _none(**given):
    base = dict.fromkeys(("sinks", "alibi_slopes", "rel_bias", "prefix_lengths", "cu_seqlens_q", "cu_seqlens_k"))
    return {**base, **given}


def test_extras_come_in_kernel_order_with_scalars_converted():
    spec = fa4gen.AttentionSpec(
        head_dim=64,
        qhead_per_kvhead=2,
        sinks=True,
        score_mod="alibi",
        scalars={"w": "int32", "s": "float32"},
        aux={"t": {"dtype": "float32", "shape": ["Hq", 3]}},
    )
    q, k = _qk()
    sinks, t = torch.randn(4), torch.randn(4, 3)
    values = variant_arguments(spec, q, k, _none(sinks=sinks), {"t": t, "w": 3, "s": 2})
    assert values[0] is sinks
    assert values[1].tolist() == pytest.approx(standard_alibi_slopes(4))  # standard slopes built for Hq
    assert values[2] is t and values[3] == 2.0 and values[4] == 3
    assert isinstance(values[3], float) and isinstance(values[4], int)


@pytest.mark.parametrize(
    "spec_fields, given, aux, message",
    [
        ({"sinks": True}, {}, None, "sinks= is missing"),
        ({"sinks": True}, {"sinks": torch.randn(3)}, None, r"sinks must be a torch.float32 tensor of shape \(4,\)"),
        ({"sinks": True}, {"sinks": torch.randn(4).double()}, None, "torch.float32"),
        ({}, {"sinks": torch.randn(4)}, None, "sinks= was given, but the spec"),
        ({"mask": "prefix_lm"}, {"prefix_lengths": torch.ones(2)}, None, "prefix_lengths must be a torch.int32"),
        ({"score_mod": {"kind": "alibi", "slopes": "tensor"}}, {}, None, "alibi_slopes= is missing"),
        (
            {"score_mod": {"kind": "relative_bias", "max_distance": 8}},
            {"rel_bias": torch.randn(4, 16)},
            None,
            r"rel_bias must be a torch.float32 tensor of shape \(4, 17\)",
        ),
        ({"scalars": {"w": "int32"}}, {}, {}, "aux\\['w'\\] is missing"),
        ({"scalars": {"w": "int32"}}, {}, {"w": 1.5}, "scalar w is int32"),
        ({"scalars": {"w": "int32"}}, {}, {"w": True}, "scalar w must be a number"),
        ({"scalars": {"w": "int32"}}, {}, {"w": 2**40}, "scalar w is int32"),
        (
            {"aux": {"t": {"dtype": "int32", "shape": ["B", "Sk"]}}},
            {},
            {"t": torch.zeros(2, 23, dtype=torch.int32)},
            r"t must be a torch.int32 tensor of shape \(2, 24\) \(B, Sk\)",
        ),
        (
            {"aux": {"t": {"dtype": "float32", "shape": [4, 4]}}},
            {},
            {"t": torch.zeros(4, 8)[:, ::2]},
            "must be contiguous",
        ),
        ({}, {}, {"nope": 1}, "aux has nope, which the spec does not declare"),
    ],
)
def test_bad_variant_arguments_raise_naming_them(spec_fields, given, aux, message):
    spec = fa4gen.AttentionSpec(head_dim=64, qhead_per_kvhead=2, **spec_fields)
    q, k = _qk()
    with pytest.raises(ValueError, match=message):
        variant_arguments(spec, q, k, _none(**given), aux)


def test_documents_check_their_cumulative_lengths():
    spec = fa4gen.AttentionSpec(head_dim=64, mask="document", causal=True)
    q, k = _qk(batch=1, sq=10, sk=12)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    ranges = torch.zeros(10, 2, dtype=torch.int32)
    tiles = torch.zeros(1, 9, dtype=torch.int32)
    given = _none(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, doc_key_ranges=ranges, doc_tiles=tiles)
    # checked, but not kernel arguments: the kernel reads the tables derived from them
    assert variant_arguments(spec, q, k, given, None) == [ranges, tiles]
    with pytest.raises(ValueError, match="cu_seqlens_k must be a torch.int32 tensor of shape \\(3,\\)"):
        variant_arguments(spec, q, k, {**given, "cu_seqlens_k": cu_k[:2]}, None)
    with pytest.raises(ValueError, match="cu_seqlens_q needs at least 2 entries"):
        variant_arguments(spec, q, k, {**given, "cu_seqlens_q": cu_q[:1], "cu_seqlens_k": cu_k[:1]}, None)
    with pytest.raises(ValueError, match="cu_seqlens_q= is missing"):
        variant_arguments(spec, q, k, _none(), None)


def test_document_tables_follow_cu_seqlens_and_are_reused():
    from fa4gen.runtime import AttentionKernel

    spec = fa4gen.AttentionSpec(head_dim=64, mask="document", causal=True)
    kernel = AttentionKernel(spec, fa4gen.plan(spec), function=None)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # an empty middle document
    ranges, tiles = kernel._document_tables(cu, cu, 7)
    # causal within each document: [document start, own position + 1)
    assert ranges.tolist() == [[0, 1], [0, 2], [0, 3], [3, 4], [3, 5], [3, 6], [3, 7]]
    assert ranges.dtype == tiles.dtype == torch.int32 and ranges.is_contiguous() and tiles.is_contiguous()
    # one query tile: its first row's range and its last row's; its rows span two documents
    assert tiles.tolist() == [[0, 0, 1, 3, 7, 0, 0, 0, 3]]
    assert kernel._document_tables(cu, cu, 7)[0] is ranges  # same tensors, unmodified: reused
    cu[1] = 1  # modified in place: rebuilt
    assert kernel._document_tables(cu, cu, 7)[0].tolist() == [[0, 1], [1, 2], [1, 3], [3, 4], [3, 5], [3, 6], [3, 7]]


def test_document_key_ranges_align_each_document_to_its_end():
    """More queries than keys in a document: its first queries see nothing (an empty range at
    the document's start); a left window cuts each row's range."""
    from fa4gen.runtime import document_tables

    spec = fa4gen.AttentionSpec(head_dim=64, mask="document", window_left=1, window_right=0)
    cu_q, cu_k = torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32)
    ranges, _ = document_tables(spec, 128, 128, cu_q, cu_k, 6)
    assert ranges.tolist() == [[0, 0], [0, 0], [0, 1], [0, 2], [2, 4], [3, 5]]


def test_document_query_tiles_are_ranked_by_work():
    """Packed causal documents: a tile's work restarts at each document, so the schedule's
    order comes from the key tiles each query tile sees, most first."""
    from fa4gen.runtime import AttentionKernel

    spec = fa4gen.AttentionSpec(head_dim=128, mask="document", causal=True)
    plan = fa4gen.plan(spec)
    kernel = AttentionKernel(spec, plan, function=None)
    doc = 4 * plan.config.tile_m  # documents of 4 query tiles each, tiles aligned to documents
    cu = torch.arange(0, 3 * doc + 1, doc, dtype=torch.int32)
    ranges, tiles = kernel._document_tables(cu, cu, 3 * doc)
    order = tiles[:, 0]
    position_in_doc = (order % 4).tolist()
    assert position_in_doc == [3, 3, 3, 2, 2, 2, 1, 1, 1, 0, 0, 0]  # last tiles of each document first
    assert sorted(order.tolist()) == list(range(12))
    first = order.long() * plan.config.tile_m  # each rank's row: its tile's first and last rows' key ranges
    assert torch.equal(tiles[:, 1:3], ranges[first]) and torch.equal(
        tiles[:, 3:5], ranges[first + plan.config.tile_m - 1]
    )
    # each tile lies in one document: its key bounds, and the shift from a row to its key position
    # (equal documents: zero); every row's range follows from them
    document = order.long() // 4
    assert tiles[:, 5].tolist() == [1] * 12 and tiles[:, 6].tolist() == [0] * 12
    assert torch.equal(tiles[:, 7].long(), document * doc) and torch.equal(tiles[:, 8].long(), (document + 1) * doc)


def test_document_tiles_carry_their_documents_bounds():
    """A tile inside one document carries the shift from its rows to their key positions and the
    document's key range, from which every row's range follows (masking.row_ranges); a tile
    whose rows span documents is flagged, and its rows' ranges are read from the table."""
    from fa4gen.runtime import document_tables

    spec = fa4gen.AttentionSpec(head_dim=64, mask="document", window_left=100, window_right=0)
    cu_q = torch.tensor([0, 300, 310, 700], dtype=torch.int32)
    cu_k = torch.tensor([0, 250, 400, 1000], dtype=torch.int32)
    ranges, tiles = document_tables(spec, 128, 128, cu_q, cu_k, 700)
    for m_block, _, _, _, _, single, shift, key_start, key_end in tiles.tolist():
        rows = torch.arange(m_block * 128, min(m_block * 128 + 128, 700))
        documents = torch.searchsorted(cu_q, rows, right=True) - 1
        assert single == int(documents.min() == documents.max()), m_block
        if single:
            position = rows + shift
            start = torch.clamp(position - 100, min=key_start)
            end = torch.clamp(position + 1, max=key_end)
            assert torch.equal(torch.stack((start, torch.maximum(end, start)), 1), ranges[rows].long()), m_block
    assert [row[5] for row in sorted(tiles.tolist())] == [1, 1, 0, 1, 1, 1]  # rows 256-383 span three


def test_each_length_range_runs_its_kernel():
    """With kernels for length ranges attached, a launch whose longest query sequence falls in a
    range goes to that range's kernel (whole: validation, tables and launch); other lengths and
    unknown ones go to the default."""
    from fa4gen.planner import seqlen_splits
    from fa4gen.runtime import SplitKernel

    spec = fa4gen.AttentionSpec(head_dim=96, causal=True)
    # (the decode kernels: test_decode_launch_goes_to_its_kernel)
    _, split, long_split, *_ = seqlen_splits(spec, "sm_90a")
    assert (split.label, long_split.label, long_split.min_seqlen_q) == ("short", "long", 4096)
    short = AttentionKernel(spec, split.plan, Recorder(), key="short")
    long = AttentionKernel(spec, long_split.plan, Recorder(), key="long")
    launched = []
    short._launch = lambda q, k, v, **kwargs: launched.append((q.shape, kwargs)) or "short result"
    kernel = AttentionKernel(
        spec,
        fa4gen.plan(spec, "sm_90a"),
        Recorder(),
        key="main",
        splits=(SplitKernel(split, short), SplitKernel(long_split, long)),
    )
    assert kernel.kernel_for(1024) is short and kernel.kernel_for(1) is short
    assert kernel.kernel_for(1025) is kernel and kernel.kernel_for(None) is kernel
    assert kernel.kernel_for(4095) is kernel and kernel.kernel_for(4096) is long and kernel.kernel_for(10**6) is long
    assert "short (at most 1024 query rows)=short" in repr(kernel)
    assert "long (at least 4096 query rows)=long" in repr(kernel)

    def qkv(seqlen_q):
        return (
            torch.randn(1, seqlen_q, 2, 96).bfloat16(),
            torch.randn(1, 9, 2, 96).bfloat16(),
            torch.randn(1, 9, 2, 96).bfloat16(),
        )

    assert kernel(*qkv(1024), out=None) == "short result"
    assert launched == [((1, 1024, 2, 96), {"out": None, "lse": None})]
    with pytest.raises(ValueError, match="q is on cpu"):  # the default kernel validates longer ones
        kernel(*qkv(1025))
    assert len(launched) == 1 and not kernel._function.calls


def test_training_a_spec_without_a_backward_is_one_error_before_any_compile(tmp_path):
    """What autograd runs is made on the first recorded call; a spec with no backward raises there,
    in one line naming the field, having compiled nothing."""
    import fa4gen.api as api
    from fa4gen.arch import Arch
    from fa4gen.cache import KernelCache

    cache = KernelCache(tmp_path)
    spec = fa4gen.AttentionSpec(
        head_dim=64, deterministic=True, score_mod={"kind": "relative_bias", "max_distance": 8, "requires_grad": True}
    )
    training = api._training_factory(spec, Arch.SM90A, cache, True)
    with pytest.raises(ValueError, match="deterministic: true with trainable tensors") as error:
        training()
    assert "\n" not in str(error.value)
    assert not list(cache.entries())


class _ReferenceTraining:
    """Stands in for TrainingKernels on the CPU: fa4gen's fp32 reference forward (with its LSE) and
    autograd of it as the backward, counting the calls."""

    def __init__(self, spec):
        from fa4gen.api import training_spec

        self.spec, self.sinks, self.calls = training_spec(spec), spec.sinks, []
        self.forward_kernel = self._forward

    def _forward(self, q, k, v, **variant):
        from fa4gen.testing import reference

        self.calls.append("forward")
        out, lse = reference(self.spec, q, k, v, args=variant)
        return out.to(q.dtype), lse

    def backward_kernel(self):
        from fa4gen.testing import reference_gradients

        def backward(q, k, v, out, dout, lse, dlse=None, **variant):
            self.calls.append("backward")
            grads = reference_gradients(self.spec, q, k, v, dout, dlse=dlse, args=variant)
            return tuple(g.to(t.dtype) for g, t in zip(grads[:3], (q, k, v))) + tuple(grads[3:])

        return backward


def test_eager_training_runs_the_kernels_without_the_op_and_routes_every_gradient():
    """An eager call under autograd goes through run_with_grad's autograd.Function (the custom op's
    autograd path is for torch.compile): one forward and one backward launch, gradients into q, k,
    v, the sink logits and the tensors the spec trains, the LSE's gradient included."""
    import torch

    from fa4gen.testing import reference_gradients

    spec = fa4gen.AttentionSpec(
        head_dim=32,
        qhead_per_kvhead=2,
        causal=True,
        sinks=True,
        return_lse=True,
        score_mod={"kind": "expression", "expr": "score * temperature[h] + shift"},
        aux={"temperature": {"dtype": "float32", "shape": ["Hq"], "requires_grad": True}},
        scalars={"shift": "float32"},
    )
    kernel = AttentionKernel(spec, fa4gen.plan(spec), function=None)
    stub = _ReferenceTraining(spec)
    kernel.training = lambda: stub
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 11, h, 32, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
    sinks, temperature = torch.randn(4, generator=gen), torch.rand(4, generator=gen) + 0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks, temperature)]
    variant = {"sinks": leaves[3], "aux": {"temperature": leaves[4], "shift": 0.25}}
    out, lse = kernel(*leaves[:3], **variant)
    dout, dlse = torch.randn(out.shape, generator=gen).to(out.dtype), torch.randn(lse.shape, generator=gen)
    torch.autograd.backward((out, lse), (dout, dlse))
    assert stub.calls == ["forward", "backward"]
    want = reference_gradients(
        spec, q, k, v, dout, dlse=dlse, args={"sinks": sinks, "aux": {"temperature": temperature, "shift": 0.25}}
    )
    for leaf, expected in zip(leaves, want, strict=True):
        torch.testing.assert_close(leaf.grad.float(), expected, atol=2e-2, rtol=2e-2)


def _recording(spec, split, launched: list) -> AttentionKernel:
    """A kernel of ``split`` whose launches append (label, query rows, keywords) to ``launched``."""
    kernel = AttentionKernel(spec, split.plan, Recorder(), key=split.label)
    kernel._launch = lambda q, k, v, **kwargs: launched.append((split.label, q.shape[1], sorted(kwargs)))
    return kernel


def test_decode_launch_goes_to_its_kernel():
    """A launch with per-entry cache lengths runs a decode kernel whatever its query length: the
    64-row one up to 64 packed rows (query rows x group), the 128-row one past them; a plain short
    launch runs the 64-row one too (its length range); a spec without a decode kernel says why,
    naming seqused_k."""
    from fa4gen.planner import seqlen_splits
    from fa4gen.runtime import SplitKernel

    spec = fa4gen.AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True)
    splits = {s.label: s for s in seqlen_splits(spec, "sm_90a")}
    assert splits["decode"].max_seqlen_q == 16 and splits["decode-wide"].cache_only
    launched = []
    decode, wide = (_recording(spec, splits[label], launched) for label in ("decode", "decode-wide"))
    kernel = AttentionKernel(
        spec,
        fa4gen.plan(spec, "sm_90a"),
        Recorder(),
        key="main",
        splits=(SplitKernel(splits["decode"], decode), SplitKernel(splits["decode-wide"], wide)),
    )
    assert kernel.decode_kernel() is decode and kernel.decode_kernel(16) is decode and kernel.decode_kernel(17) is wide
    q, k, v = (
        torch.randn(1, 300, 8, 128).bfloat16(),
        torch.randn(1, 9, 2, 128).bfloat16(),
        torch.randn(1, 9, 2, 128).bfloat16(),
    )
    lengths = torch.tensor([5], dtype=torch.int32)
    for rows in (300, 17, 16, 1):
        kernel(q[:, :rows], k, v, seqused_k=lengths)
    kernel(q[:, :16], k, v)
    cache = ["lse", "out", "seqused_k"]
    assert launched == [
        ("decode-wide", 300, cache),
        ("decode-wide", 17, cache),
        ("decode", 16, cache),
        ("decode", 1, cache),
        ("decode", 16, ["lse", "out"]),
    ]
    with pytest.raises(ValueError, match="q is on cpu"):  # longer plain launches: the forward kernel
        kernel(q[:, :17], k, v)
    documents = fa4gen.AttentionSpec(head_dim=128, causal=True, mask="document")
    plain = AttentionKernel(documents, fa4gen.plan(documents, "sm_90a"), Recorder())
    with pytest.raises(ValueError, match="seqused_k= needs the decode kernel.*mask: document"):
        plain(q, k, v, seqused_k=lengths)
    with pytest.raises(ValueError, match="page_table= needs the paged decode kernel.*mask: document"):
        plain(q, k, v, page_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="page_table= runs on the paged decode kernel"):  # (a bare range's kernel)
        AttentionKernel._launch(decode, q, k, v, page_table=torch.zeros(1, 1, dtype=torch.int32))


def test_paged_launch_goes_to_the_paged_kernel():
    """A launch with a page table runs a paged kernel whatever its query length, with or without
    cache lengths: the 64-row one up to 64 packed rows, the 128-row one past them."""
    from fa4gen.planner import seqlen_splits
    from fa4gen.runtime import SplitKernel

    spec = fa4gen.AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True)
    splits = {s.label: s for s in seqlen_splits(spec, "sm_90a")}
    assert all(splits[label].page_table for label in ("paged", "paged-wide"))
    launched = []
    paged, wide = (_recording(spec, splits[label], launched) for label in ("paged", "paged-wide"))
    kernel = AttentionKernel(
        spec,
        fa4gen.plan(spec, "sm_90a"),
        Recorder(),
        key="main",
        splits=(SplitKernel(splits["paged"], paged), SplitKernel(splits["paged-wide"], wide)),
    )
    assert kernel.paged_kernel() is paged and kernel.paged_kernel(17) is wide and kernel.kernel_for(1) is kernel
    q, pool = torch.randn(2, 300, 8, 128).bfloat16(), torch.randn(5, 16, 2, 128).bfloat16()
    table, lengths = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([5, 40], dtype=torch.int32)
    kernel(q, pool, pool, page_table=table)
    kernel(q[:, :16], pool, pool, page_table=table)
    kernel(q[:, :1], pool, pool, page_table=table, seqused_k=lengths)
    assert launched == [
        ("paged-wide", 300, ["lse", "out", "page_table"]),
        ("paged", 16, ["lse", "out", "page_table"]),
        ("paged", 1, ["lse", "out", "page_table", "seqused_k"]),
    ]


def _pool(pages: int, page_size: int):
    return torch.randn(pages, page_size, 2, 128).bfloat16()


@pytest.mark.parametrize(
    "k, v, table, message",
    [
        (_pool(4, 24), _pool(4, 24), torch.zeros(2, 3, dtype=torch.int32), "page pool .* multiple of 16 tokens"),
        (_pool(4, 8), _pool(4, 8), torch.zeros(2, 3, dtype=torch.int32), "multiple of 16 tokens"),
        (_pool(4, 16), _pool(5, 16), torch.zeros(2, 3, dtype=torch.int32), "k and v must be one page pool"),
        (_pool(4, 16), _pool(4, 16), torch.zeros(2, 3), "page_table must be int32 of shape \\(2, max_pages\\)"),
        (_pool(4, 16), _pool(4, 16), torch.zeros(3, 3, dtype=torch.int32), "of shape \\(2, max_pages\\)"),
        (_pool(4, 16), _pool(4, 16), torch.zeros(2, dtype=torch.int32), "of shape \\(2, max_pages\\)"),
        (_pool(4, 16), _pool(4, 16), torch.zeros(2, 0, dtype=torch.int32), "no columns"),
        (_pool(4, 16), _pool(4, 16), torch.zeros(3, 2, dtype=torch.int32).t(), "must be contiguous"),
        (_pool(4, 16), _pool(4, 16), [[0, 1], [2, 3]], "page_table must be a torch.Tensor"),
    ],
)
def test_bad_page_tables_raise_naming_the_argument(k, v, table, message):
    from fa4gen.kv_cache import check_page_table

    q = torch.randn(2, 1, 8, 128).bfloat16()
    with pytest.raises(ValueError, match=message):
        check_page_table(table, q, k, v)
    check_page_table(torch.zeros(2, 3, dtype=torch.int32), q, _pool(4, 16), _pool(4, 16))


@pytest.mark.parametrize(
    "lengths, message",
    [
        ("5", "seqused_k must be a torch.Tensor"),
        (torch.tensor([5, 6]), "int32 of shape \\(2,\\), got torch.int64"),
        (torch.tensor([5], dtype=torch.int32), "of shape \\(2,\\)"),
        (torch.tensor([[5, 6]], dtype=torch.int32), "of shape \\(2,\\)"),
        (torch.tensor([5, 0, 6, 0], dtype=torch.int32)[::2], "must be contiguous"),
    ],
)
def test_bad_cache_lengths_raise_naming_the_argument(lengths, message):
    from fa4gen.kv_cache import check_cache_lengths

    with pytest.raises(ValueError, match=message):
        check_cache_lengths(lengths, 2, torch.device("cpu"))
    check_cache_lengths(torch.tensor([5, 0], dtype=torch.int32), 2, torch.device("cpu"))


def test_a_page_pool_sizes_sk_tensors_by_its_capacity():
    """An aux tensor over the keys ("Sk") of a paged launch has one entry per key of an entry's
    pages (table columns x page size), not per key of one page."""
    from fa4gen.runtime import variant_arguments

    spec = fa4gen.AttentionSpec(
        head_dim=128,
        qhead_per_kvhead=4,
        causal=True,
        score_mod={"kind": "expression", "expr": "score + key_bias[kv_idx]"},
        aux={"key_bias": {"dtype": "float32", "shape": ["Sk"]}},
    )
    q, pool = torch.randn(2, 1, 8, 128).bfloat16(), torch.randn(9, 16, 2, 128).bfloat16()
    assert len(variant_arguments(spec, q, pool, {}, {"key_bias": torch.randn(48)}, seqlen_k=3 * 16)) == 1
    with pytest.raises(ValueError, match="key_bias must be a torch.float32 tensor of shape \\(48,\\)"):
        variant_arguments(spec, q, pool, {}, {"key_bias": torch.randn(16)}, seqlen_k=3 * 16)
