"""Spec files: YAML in (safe loader, plain data only) and out."""

from __future__ import annotations

from pathlib import Path

import yaml

from fa4gen.spec import AttentionSpec


def load_spec(path: str | Path) -> AttentionSpec:
    """Read a spec from a YAML file (safe loader: plain data only)."""
    text = Path(path).read_text()
    return spec_from_yaml(text)


def spec_from_yaml(text: str) -> AttentionSpec:
    data = yaml.safe_load(text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"a spec YAML must be a mapping of fields, got {type(data).__name__}")
    return AttentionSpec.model_validate(data)


def dump_spec(spec: AttentionSpec, path: str | Path | None = None) -> str:
    """The spec as YAML (only fields that differ from their defaults); written to ``path`` if given."""
    data = spec.model_dump(exclude_defaults=True)
    text = yaml.safe_dump(data, sort_keys=True) if data else "{}\n"
    if path is not None:
        Path(path).write_text(text)
    return text
