"""Everything in examples/ runs (the GPU halves of the examples run in the device runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _run(args, env_extra, cwd=ROOT):
    env = {**os.environ, **env_extra}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_quickstart_cross_compiles_without_gpu(warm_cache):
    root, _ = warm_cache  # llama3-8b is already in it: the example must hit it, not recompile
    result = _run([sys.executable, "examples/quickstart.py", "--cpu"], {"FA4GEN_CACHE_DIR": str(root)})
    assert result.returncode == 0, result.stderr
    assert "plan for sm_90a" in result.stdout and "cache hit" in result.stdout


def test_training_example_builds_what_training_runs_without_gpu(tmp_path):
    """examples/training.py --cpu: the forward with its LSE, the backward and the plain forward."""
    result = _run([sys.executable, "examples/training.py", "--cpu"], {"FA4GEN_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "HopperAttentionBackward" in result.stdout and "compiled in" in result.stdout
    again = _run([sys.executable, "examples/training.py", "--cpu"], {"FA4GEN_CACHE_DIR": str(tmp_path)})
    assert again.returncode == 0 and "cache hit" in again.stdout, again.stderr


def test_variants_example_cross_compiles_without_gpu(warm_cache):
    root, _ = warm_cache  # both specs are in specs/, so already warm: the example hits them
    result = _run([sys.executable, "examples/variants.py", "--cpu"], {"FA4GEN_CACHE_DIR": str(root)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("cache hit") == 2, result.stdout


def test_transformers_example_cross_compiles_and_falls_back_on_cpu(warm_cache):
    """examples/transformers_model.py --cpu: the specs of each model's layer types, cross-compiled,
    and on the CPU every layer falls back to transformers' own attention with the same logits."""
    root, _ = warm_cache
    result = _run([sys.executable, "examples/transformers_model.py", "--cpu"], {"FA4GEN_CACHE_DIR": str(root)})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("on the CPU every layer falls back: max |logits") == 2, out
    assert "= 0.0e+00" in out and "sliding_attention/bfloat16/packed" in out, out
    assert "tensors on cpu: fa4gen kernels run on CUDA GPUs" in out, out


@pytest.mark.skipif(shutil.which("fa4gen") is None, reason="console script not installed")
def test_ci_warm_script_ships_a_cache_that_loads_without_compiling(tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "tiny.yaml").write_text("head_dim: 64\ncausal: true\n")
    archive = tmp_path / "cache.tar.gz"
    built = _run(
        ["bash", "examples/ci/warm-cache.sh", str(specs), str(archive)],
        {"FA4GEN_CACHE_DIR": str(tmp_path / "ci-cache")},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert archive.is_file()
    runtime = {"FA4GEN_CACHE_DIR": str(tmp_path / "runtime-cache"), "FA4GEN_NO_COMPILE": "1"}
    assert _run(["fa4gen", "cache", "import", str(archive)], runtime).returncode == 0
    hit = _run(["fa4gen", "compile", str(specs / "tiny.yaml"), "--arch", "sm_90a"], runtime)
    assert hit.returncode == 0, hit.stdout + hit.stderr
    assert "cache hit" in hit.stdout
