"""Identity of what produced an artifact: fa4gen's own sources and the CuTe DSL toolchain.

Read without importing the CuTe DSL compiler (package metadata only), so a cache hit stays cheap.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import os
import re
from functools import lru_cache
from pathlib import Path

from fa4gen._version import __version__

TOOLCHAIN_ENV = "FA4GEN_TOOLCHAIN"  # e.g. "cutlass-dsl=4.8.1,cuda=cu13" where no distribution metadata exists
TOOLCHAIN_FORM = "cutlass-dsl=4.8.1,cuda=cu13"
_DSL_DISTS = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base")
_FLAVOURS = ("cu13", "cu12")  # newest first: with no driver present the DSL compiles for the newest
_VERSION_RE = re.compile(r"[0-9][0-9A-Za-z.+!-]{0,63}")  # a PEP 440 version, loosely: it goes into cache keys


class ToolchainError(RuntimeError):
    """The CuTe DSL toolchain cannot be identified (not installed, or a malformed override)."""


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def parse_override(text: str) -> dict[str, str]:
    """{"cutlass_dsl": version, "cuda": flavour} from a FA4GEN_TOOLCHAIN value such as
    ``cutlass-dsl=4.8.1,cuda=cu13``; a ToolchainError (one line) for anything else."""
    shown = text if len(text) <= 80 else text[:77] + "..."
    problem = f"{TOOLCHAIN_ENV}={shown!r} is not a toolchain: expected the form {TOOLCHAIN_FORM}"
    fields: dict[str, str] = {}
    for part in text.split(","):
        name, equals, value = part.partition("=")
        if not equals or name.strip() in fields:
            raise ToolchainError(problem)
        fields[name.strip()] = value.strip()
    if set(fields) != {"cutlass-dsl", "cuda"}:
        raise ToolchainError(problem)
    if not _VERSION_RE.fullmatch(fields["cutlass-dsl"]):
        raise ToolchainError(f"{problem} (cutlass-dsl is a version such as 4.8.1)")
    if fields["cuda"] not in _FLAVOURS:
        raise ToolchainError(f"{problem} (cuda is one of {', '.join(_FLAVOURS)})")
    return {"cutlass_dsl": fields["cutlass-dsl"], "cuda": fields["cuda"]}


@lru_cache(maxsize=1)
def toolchain() -> dict[str, str]:
    """{"cutlass_dsl": version, "cuda": flavour} of the installed CuTe DSL (or of FA4GEN_TOOLCHAIN)."""
    override = os.environ.get(TOOLCHAIN_ENV, "").strip()
    if override:
        return parse_override(override)
    version = next((v for v in map(_dist_version, _DSL_DISTS) if v), None)
    if version is None:
        raise ToolchainError(
            "cannot identify the CuTe DSL toolchain: install nvidia-cutlass-dsl, or set "
            f"{TOOLCHAIN_ENV}={TOOLCHAIN_FORM} (the toolchain that warmed the cache) on a machine that only "
            "runs cached kernels"
        )
    flavour = next((f for f in _FLAVOURS if _dist_version(f"nvidia-cutlass-dsl-libs-{f}")), "cu12")
    return {"cutlass_dsl": version, "cuda": flavour}


def package_root() -> Path:
    return Path(__file__).resolve().parent


# Host-side modules that never shape an artifact: editing them must not invalidate caches.
# Everything else in the package (spec, planner, emitter, compiler, kernels/, and any module
# added later) is part of the fingerprint, so the default is to invalidate.
HOST_ONLY_MODULES = frozenset(
    {
        "__init__.py",
        "api.py",
        "background.py",
        "background_child.py",
        "backward.py",
        "bench.py",
        "blockmask.py",
        "cache.py",
        "cache_archive.py",
        "cache_base.py",
        "cli.py",
        "custom_op.py",
        "handles.py",
        "hf.py",
        "kernels/sm90/decode_splits.py",  # the split count is a launch argument
        "kv_cache.py",
        "ops.py",
        "runtime.py",
        "tensor_checks.py",
        "testing.py",
        "tuned.py",
        "tuning.py",
        "warm.py",
    }
)
HOST_ONLY_PACKAGES = frozenset({"integrations"})  # glue into other frameworks: calls kernels, never shapes one


def _host_only(relative: Path) -> bool:
    return relative.as_posix() in HOST_ONLY_MODULES or relative.parts[0] in HOST_ONLY_PACKAGES


@lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 over the fa4gen sources that produce artifacts, and the kernel templates."""
    from fa4gen.emitter import templates_dir

    digest = hashlib.sha256(__version__.encode())
    roots = [("fa4gen", package_root(), "*.py"), ("templates", templates_dir(), "*.jinja")]
    for label, root, pattern in roots:
        for path in sorted(root.rglob(pattern)):
            relative = path.relative_to(root)
            if "__pycache__" in path.parts or (label == "fa4gen" and _host_only(relative)):
                continue
            digest.update(f"{label}/{relative.as_posix()}\0".encode())
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()
