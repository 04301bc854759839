"""The attention variant a user asks for: a frozen pydantic model, YAML in and out.

A spec says *what* to compute, never *how*: tile sizes and pipeline depth are the planner's
(`fa4gen.planner`). Every field is validated on construction with a message that names the field,
the bad value and what is allowed, so a bad YAML file fails before anything is planned or compiled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MIN_HEAD_DIM = 8
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # TMA moves rows in 16-byte units: 8 half-precision elements
MAX_QHEAD_PER_KVHEAD = 256
MAX_WINDOW = 2**30  # kernels index in int32: a window at least this long is the same as none
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38
LOG2E = math.log2(math.e)

_DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def _check_head_dim(name: str, value: int) -> int:
    if not MIN_HEAD_DIM <= value <= MAX_HEAD_DIM or value % HEAD_DIM_MULTIPLE:
        raise ValueError(
            f"{name}={value} is not supported: allowed are multiples of {HEAD_DIM_MULTIPLE} "
            f"from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}"
        )
    return value


class AttentionSpec(BaseModel):
    """One attention variant (forward pass).

    Shapes at call time: q (B, Sq, Hq, head_dim), k (B, Sk, Hkv, head_dim),
    v (B, Sk, Hkv, head_dim_v) with Hq = qhead_per_kvhead * Hkv; the output o is
    (B, Sq, Hq, head_dim_v) and, with ``return_lse``, lse is (B, Hq, Sq) in float32.

    Masks are aligned bottom-right when Sq != Sk (query i sits at key position
    i + Sk - Sq), as in FlashAttention 2 and later. ``window_left`` / ``window_right`` bound
    the keys a query sees to [i + Sk - Sq - left, i + Sk - Sq + right]; ``causal`` is the
    same as ``window_right=0``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    dtype: Literal["bfloat16", "float16"] = Field(
        "bfloat16", description="Element type of q, k, v and o (aliases: bf16, fp16)."
    )
    head_dim: int = Field(128, description="Head dimension of q and k: multiple of 8 in 8..256.")
    head_dim_v: int | None = Field(
        None, description="Head dimension of v and o (default: head_dim): multiple of 8 in 8..256."
    )
    qhead_per_kvhead: int = Field(
        1, description="Query heads per key/value head: 1 is MHA, >1 is GQA/MQA."
    )
    causal: bool = Field(False, description="Each query sees only keys at or before its position.")
    window_left: int | None = Field(
        None, description="Sliding window: keys at most this far before the query (None: unbounded)."
    )
    window_right: int | None = Field(
        None, description="Sliding window: keys at most this far after the query (None: unbounded)."
    )
    softcap: float | None = Field(
        None, description="Tanh soft-capping of scores: softcap * tanh(s / softcap), s already scaled."
    )
    softmax_scale: float | None = Field(
        None, description="Multiplier of q.k before softmax (default 1/sqrt(head_dim))."
    )
    return_lse: bool = Field(False, description="Also return the log-sum-exp per query row (B, Hq, Sq).")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[value.lower()]
        if isinstance(value, str):
            raise ValueError(f"dtype={value!r} is not supported: allowed are bfloat16 (bf16), float16 (fp16)")
        return value

    @field_validator("head_dim")
    @classmethod
    def _head_dim(cls, value: int) -> int:
        return _check_head_dim("head_dim", value)

    @field_validator("head_dim_v")
    @classmethod
    def _head_dim_v(cls, value: int | None) -> int | None:
        return None if value is None else _check_head_dim("head_dim_v", value)

    @field_validator("qhead_per_kvhead")
    @classmethod
    def _ratio(cls, value: int) -> int:
        if not 1 <= value <= MAX_QHEAD_PER_KVHEAD:
            raise ValueError(f"qhead_per_kvhead={value} is not supported: allowed is 1..{MAX_QHEAD_PER_KVHEAD}")
        return value

    @field_validator("window_left", "window_right")
    @classmethod
    def _window(cls, value: int | None, info: Any) -> int | None:
        if value is not None and not 0 <= value <= MAX_WINDOW:
            raise ValueError(
                f"{info.field_name}={value} is not allowed: use an integer in 0..{MAX_WINDOW}, or null for no bound"
            )
        return value

    @field_validator("softcap")
    @classmethod
    def _softcap(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"softcap={value} is not allowed: use a finite number > 0, or null for none")
        return value

    @field_validator("softmax_scale")
    @classmethod
    def _scale(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"softmax_scale={value} is not allowed: use a finite number > 0, or null for 1/sqrt(head_dim)")
        return value

    @model_validator(mode="after")
    def _float32_constants(self) -> AttentionSpec:
        """The kernel folds the scale into float32 constants: they must be normal float32 numbers."""
        if self.softcap is None:
            constants = {"softmax_scale * log2(e)": self.scale * LOG2E}
        else:
            constants = {"softcap": self.softcap, "softmax_scale / softcap": self.scale / self.softcap}
        for name, value in constants.items():
            if not FLOAT32_MIN_NORMAL <= value <= FLOAT32_MAX:
                raise ValueError(
                    f"softmax_scale={self.softmax_scale}, softcap={self.softcap}: {name} = {value:g} is outside "
                    f"the normal float32 range [{FLOAT32_MIN_NORMAL:g}, {FLOAT32_MAX:g}] the kernel computes in"
                )
        return self

    @model_validator(mode="after")
    def _causal_window(self) -> AttentionSpec:
        if self.causal and self.window_right not in (None, 0):
            raise ValueError(
                f"window_right={self.window_right} conflicts with causal=true: a causal mask already "
                "fixes window_right=0; drop window_right or set causal=false"
            )
        return self

    # ---- resolved values (what the planner and kernel use) ----
    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.softmax_scale is None else self.softmax_scale

    @property
    def right_bound(self) -> int | None:
        """Keys visible after the query position (None: unbounded)."""
        return 0 if self.causal else self.window_right

    @property
    def left_bound(self) -> int | None:
        return self.window_left

    @property
    def has_mask(self) -> bool:
        return self.right_bound is not None or self.left_bound is not None

    def canonical(self) -> dict[str, Any]:
        """Defaults resolved, so two specs that compute the same thing compare equal."""
        data = self.model_dump()
        data["head_dim_v"] = self.dv
        data["softmax_scale"] = self.scale
        data["causal"] = self.right_bound == 0
        data["window_right"] = None if self.right_bound == 0 else self.window_right
        return data

    def canonicalized(self) -> AttentionSpec:
        """The equivalent spec with every default resolved (what artifacts are built from)."""
        return AttentionSpec.model_validate(self.canonical())

    def canonical_json(self) -> str:
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))

    def summary(self) -> str:
        parts = [self.dtype, f"d{self.head_dim}" + (f"/{self.dv}" if self.dv != self.head_dim else "")]
        if self.qhead_per_kvhead > 1:
            parts.append(f"gqa{self.qhead_per_kvhead}")
        if self.causal:
            parts.append("causal")
        if self.window_left is not None or self.window_right is not None:
            parts.append(f"window({self.window_left},{self.right_bound})")
        if self.softcap is not None:
            parts.append(f"softcap{self.softcap:g}")
        if self.return_lse:
            parts.append("lse")
        return " ".join(parts)


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


def spec_json_schema() -> dict[str, Any]:
    return AttentionSpec.model_json_schema()
