"""The kernels the GPU tests run, in one place: the warm script compiles exactly these.

GPU test machines may have only the CuTe DSL runtime (no compiler), so these specs are
compiled beforehand (`python tests/warm_gpu_cache.py DIR`) and the cache travels with the tests.
"""

from __future__ import annotations

from pathlib import Path

from fa4gen import AttentionSpec, load_spec

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"

# (batch, seqlen_q, seqlen_k): 1, ragged tiles (17, 1000, 4097), Sq != Sk both ways
SHAPES = [(1, 1, 1), (3, 17, 17), (1, 1000, 1000), (3, 4097, 4097), (1, 17, 1000), (3, 1000, 17), (1, 1, 4097)]


def spec_files() -> list[Path]:
    return sorted(SPECS_DIR.glob("*.yaml"))


def gpu_specs() -> dict[str, AttentionSpec]:
    """Every spec in specs/ with the LSE output on (so O and LSE are both checked), plus each
    spec as written when it has no LSE (the launch path without an LSE tensor)."""
    cases: dict[str, AttentionSpec] = {}
    for path in spec_files():
        spec = load_spec(path)
        cases[f"{path.stem}+lse"] = spec.model_copy(update={"return_lse": True})
        if not spec.return_lse:
            cases[path.stem] = spec
    return cases


def example_specs() -> dict[str, AttentionSpec]:
    """What examples/quickstart.py compiles on a GPU."""
    spec = AttentionSpec(head_dim=128, qhead_per_kvhead=4, causal=True, dtype="bfloat16")
    return {"quickstart": spec, "quickstart+lse": spec.model_copy(update={"return_lse": True})}
