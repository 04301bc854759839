"""fa4gen's kernels for transformers' model families against transformers' eager attention, on
the GPU (marker `gpu`; skipped without one, or without transformers).

For every family and layer type of tests/hf_cases.py's GPU configs (windows of 257 and 128 keys,
chunks of 300; GQA, sinks, softcap, ALiBi, NoPE temperature and 192/128 head dims as in the
models), on prefill and KV-cache shapes: fresh random bf16 inputs, the kernel of the spec
fa4gen.hf maps the config to (from the cache, warmed beforehand with the specs of
hf_cases.hf_gpu_specs()) launched into NaN-filled outputs, and its error against transformers'
attention computed in float32 from the same bf16 values at most 2x transformers' own bf16 error
(its attention run in bf16); then against fa4gen's float32 reference with its bound.
"""

from __future__ import annotations

import pytest
from hf_cases import (
    GPU_CHUNKED_SHAPES,
    GPU_FAMILIES,
    GPU_SHAPES,
    assert_matches_transformers,
    case_id,
    cases,
    hf_case,
    hf_gpu_specs,
)

import fa4gen

pytestmark = pytest.mark.gpu
try:
    import transformers  # noqa: F401
except ImportError as exc:  # any, not only a missing module (pytest.importorskip's default)
    pytest.skip(f"transformers is not importable: {exc}", allow_module_level=True)

CASES = cases(GPU_FAMILIES, GPU_SHAPES, GPU_CHUNKED_SHAPES)
SPECS = hf_gpu_specs()


def _run_poisoned(spec, attn, q, k, v, args):
    """Launch into a NaN-filled output and return it."""
    import torch

    out = torch.full((*q.shape[:-1], spec.dv), float("nan"), device=q.device, dtype=q.dtype)
    assert attn(q, k, v, out=out, **args) is out
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("family, layer_type, past, new", [pytest.param(*c, id=case_id(*c)) for c in CASES])
def test_kernel_matches_transformers(family, layer_type, past, new):
    import torch

    seed = hash((family, layer_type, past, new)) % 2**31  # fresh per process
    case = hf_case(family, layer_type, past, new, dtype=torch.bfloat16, device="cuda", seed=seed, configs=GPU_FAMILIES)
    assert case.spec == SPECS[f"{family}/{layer_type}"]  # the kernel the warm step compiled
    out = _run_poisoned(case.spec, fa4gen.compile(case.spec), case.q, case.k, case.v, case.args)
    try:
        assert_matches_transformers(case, out)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (seed {seed}, Sk {case.k.shape[1]})") from None
