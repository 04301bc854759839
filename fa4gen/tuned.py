"""Plans recorded by ``fa4gen tune`` (fa4gen.tuning) for the device they were measured on.

Records are small JSON files written atomically under the cache root (tuned/ARCH/DEVICE/KEY.json):
``{"spec", "arch", "device", "plan", "measurements", "recorded"}``, ``plan`` being
``Plan.model_dump()`` (arch, kernel, config, reasons). A record is ignored, with a RuntimeWarning
naming its file, where it cannot be read, was written by an older fa4gen (a flat plan without
``config``), no longer parses as a Plan, fails the kernel's check (``plan_problem``), or fixes
the spec's own constants (head dims, scale, mask, ...) otherwise than the planner does now;
compile() then runs the planner's plan, and ``fa4gen tune`` writes a new record.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import warnings
from pathlib import Path

from fa4gen.arch import Arch
from fa4gen.cache import make_key
from fa4gen.planner import Plan, plan_problem
from fa4gen.planner.sm90 import variant_fields
from fa4gen.spec import AttentionSpec

TUNED_DIR = "tuned"


def current_device_name() -> str | None:
    """Name of the current CUDA device (host-side query), or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def _record_path(cache_root: Path, spec: AttentionSpec, arch: Arch, device: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower() or "device"
    return Path(cache_root) / TUNED_DIR / arch.value / slug / f"{make_key({'spec': spec.canonical()})}.json"


def tuned_plan(cache_root: Path, spec: AttentionSpec, arch: Arch, device: str) -> Plan | None:
    """The plan recorded for (spec, arch, device), or None (see the module docstring for the
    records that are ignored, with a warning)."""
    path = _record_path(cache_root, spec, arch, device)
    try:
        record = json.loads(path.read_text())
        data = record["plan"]
        if isinstance(data, dict) and "config" not in data and "tile_n" in data:
            raise ValueError("written by an older fa4gen (a plan without a kernel config); run fa4gen tune again")
        recorded = Plan.model_validate(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"ignoring the tuned plan in {path}: {exc}", RuntimeWarning, stacklevel=2)
        return None
    if recorded.arch != arch.value:
        return None
    problem = plan_problem(recorded) or _spec_mismatch(spec, recorded)
    if problem:
        warnings.warn(
            f"ignoring the tuned plan in {path}: {problem}; run fa4gen tune again", RuntimeWarning, stacklevel=2
        )
        return None
    return recorded


def _spec_mismatch(spec: AttentionSpec, recorded: Plan) -> str:
    """Which of the config fields the spec fixes the record holds otherwise than the planner."""
    fixed = variant_fields(spec)
    differ = [name for name, value in fixed.items() if getattr(recorded.config, name) != value]
    return f"its {', '.join(differ)} differ from the planner's for this spec" if differ else ""


def record_plan(
    cache_root: Path, spec: AttentionSpec, arch: Arch, device: str, plan: Plan, measurements: list[dict]
) -> Path:
    path = _record_path(cache_root, spec, arch, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "spec": spec.canonical(),
        "arch": arch.value,
        "device": device,
        "plan": plan.model_dump(),
        "measurements": measurements,
        "recorded": time.time(),
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path
