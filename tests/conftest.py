"""Shared fixtures. GPU tests (marker `gpu`) skip on machines without a CUDA GPU."""

from __future__ import annotations

import pytest


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """Every spec in specs/ cross-compiled for sm_90a into one cache (shared by the CPU tests)."""
    from gpu_cases import spec_files

    import fa4gen

    root = tmp_path_factory.mktemp("fa4gen-cache")
    results = {}
    for path in spec_files():
        results[path.stem] = fa4gen.build(fa4gen.load_spec(path), "sm_90a", cache_dir=root)
    return root, results
