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
