"""The attention variant a user asks for: a frozen pydantic model, YAML in and out.

A spec says *what* to compute, never *how*: tile sizes and pipeline depth are the planner's
(`fa4gen.planner`). Every field is validated on construction with a message that names the field,
the bad value and what is allowed, so a bad YAML file fails before anything is planned or compiled.
"""

from __future__ import annotations

import json
import keyword
import math
import unicodedata
from typing import Annotated, Any, Literal, Union

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


SIZE_NAMES = ("B", "Hq", "Hkv", "Sq", "Sk")  # symbolic dims an aux tensor shape may use
MAX_AUX_DIMS = 4
MAX_RELATIVE_DISTANCE = 65536
RESERVED_NAMES = frozenset(
    {
        "score",
        "b",
        "h",
        "q_idx",
        "kv_idx",
        "seqlen_q",
        "seqlen_k",
        "alibi_slopes",
        "rel_bias",
        "where",
        "min",
        "max",
        "abs",
        "exp",
        "exp2",
        "log",
        "tanh",
        "True",
        "False",
    }
)


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SlidingWindowMask(_Part):
    """Same as the flat ``window_left`` / ``window_right`` fields (it is normalised into them)."""

    kind: Literal["sliding_window"]
    left: int | None = None
    right: int | None = None


class CausalMask(_Part):
    kind: Literal["causal"]


class NoMask(_Part):
    kind: Literal["none"]


class ChunkedMask(_Part):
    """Llama-4 chunked attention: a query sees only earlier keys of its own chunk of ``size``."""

    kind: Literal["chunked"]
    size: int = Field(..., ge=1, le=MAX_WINDOW)


class PrefixLMMask(_Part):
    """Bidirectional over a per-batch prefix, causal after it; the prefix lengths are a run-time
    int32 tensor of shape (B,) passed as ``prefix_lengths=``."""

    kind: Literal["prefix_lm"]


class DocumentMask(_Part):
    """Packed sequences (varlen): q, k, v are (total, H, D) and ``cu_seqlens_q`` / ``cu_seqlens_k``
    (int32, num_docs + 1) delimit the documents; a query sees only keys of its own document
    (combined with ``causal`` / windows, aligned bottom-right per document)."""

    kind: Literal["document"]


class ExpressionMask(_Part):
    """A condition over b, h, q_idx, kv_idx, seqlen_q, seqlen_k, declared scalars and aux
    tensors: True where the key is visible (see fa4gen.expr). ANDed with causal / windows."""

    kind: Literal["expression"]
    expr: str


class SoftcapMod(_Part):
    """Same as the flat ``softcap`` field (it is normalised into it)."""

    kind: Literal["softcap"]
    cap: float


class AlibiMod(_Part):
    """score - slope[h] * |q_pos - k_pos| (positions aligned bottom-right). ``standard`` slopes are
    the ALiBi paper's geometric sequence for the call's head count; ``tensor`` takes a float32
    (Hq,) tensor as ``alibi_slopes=``."""

    kind: Literal["alibi"]
    slopes: Literal["standard", "tensor"] = "standard"
    # the slopes tensor trains: the backward gives its gradient (slopes: tensor only)
    requires_grad: bool = False

    @model_validator(mode="after")
    def _trainable_tensor(self) -> AlibiMod:
        if self.requires_grad and self.slopes != "tensor":
            raise ValueError("score_mod.requires_grad: only slopes: tensor can train (standard slopes are constants)")
        return self


class RelativeBiasMod(_Part):
    """score + rel_bias[h, clip(k_pos - q_pos, -max_distance, max_distance) + max_distance]: a
    run-time float32 table of shape (Hq, 2 * max_distance + 1) passed as ``rel_bias=`` (T5 style)."""

    kind: Literal["relative_bias"]
    max_distance: int = Field(..., ge=1, le=MAX_RELATIVE_DISTANCE)
    requires_grad: bool = False  # the table trains: the backward gives its gradient


class ExpressionMod(_Part):
    """A number over score (already scaled by softmax_scale), b, h, q_idx, kv_idx, seqlen_q,
    seqlen_k, declared scalars and aux tensors (see fa4gen.expr)."""

    kind: Literal["expression"]
    expr: str


class AuxTensorSpec(_Part):
    """A tensor an expression reads, passed at call time in ``aux={name: tensor}``; its values
    never recompile. ``shape`` entries are integers or the call's sizes B, Hq, Hkv, Sq, Sk."""

    dtype: Literal["float32", "int32"]
    shape: tuple[int | Literal["B", "Hq", "Hkv", "Sq", "Sk"], ...] = Field(..., min_length=1, max_length=MAX_AUX_DIMS)
    # the tensor trains: the backward gives its gradient (float32 tensors the score_mod reads)
    requires_grad: bool = False

    @field_validator("shape")
    @classmethod
    def _positive(cls, value: tuple) -> tuple:
        for dim in value:
            if isinstance(dim, int) and not 1 <= dim <= 2**31 - 1:
                raise ValueError(f"aux dimension {dim} is not allowed: use 1..2^31-1 or one of {', '.join(SIZE_NAMES)}")
        return value


def _check_declared_name(name: str) -> None:
    """Declared names become identifiers in generated code: plain ASCII, so no two differ only by
    Unicode forms Python folds together (fullwidth ``ｂ`` reads as the batch index ``b``)."""
    if not name.isascii():
        folded = unicodedata.normalize("NFKC", name)
        hint = f" (Python reads it as {folded!r})" if folded.isascii() and folded.isidentifier() else ""
        shown = name.encode("ascii", "backslashreplace").decode()[:80]
        raise ValueError(f"aux/scalar name '{shown}' is not allowed: names are ASCII letters, digits and _{hint}")
    if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_") or name in RESERVED_NAMES:
        raise ValueError(
            f"aux/scalar name {name[:80]!r} is not allowed: use an ASCII identifier that is not a Python "
            f"keyword, not one of {', '.join(sorted(RESERVED_NAMES))}, and does not start with _"
        )


MaskField = Annotated[
    Union[NoMask, CausalMask, SlidingWindowMask, ChunkedMask, PrefixLMMask, DocumentMask, ExpressionMask],
    Field(discriminator="kind"),
]
ScoreModField = Annotated[Union[SoftcapMod, AlibiMod, RelativeBiasMod, ExpressionMod], Field(discriminator="kind")]


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
    qhead_per_kvhead: int = Field(1, description="Query heads per key/value head: 1 is MHA, >1 is GQA/MQA.")
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
    deterministic: bool = Field(
        False,
        description="Training: gradients bit-identical from run to run (the key tiles add into dQ in "
        "a fixed order; the forward is unchanged).",
    )
    mask: MaskField | None = Field(
        None,
        description="none | causal | sliding_window | chunked | prefix_lm | document | expression "
        "(a string for kinds without parameters, else a mapping with `kind`).",
    )
    score_mod: ScoreModField | None = Field(
        None,
        description="softcap | alibi | relative_bias | expression, applied to the scaled score "
        "(before softcap when both are given).",
    )
    sinks: bool = Field(
        False,
        description="Learnable per-head sink logits (float32 (Hq,), passed as sinks=): "
        "each row's softmax also counts exp(sink), which takes no value.",
    )
    aux: dict[str, AuxTensorSpec] = Field(default_factory=dict, description="Tensors expressions read, by name.")
    scalars: dict[str, Literal["float32", "int32"]] = Field(
        default_factory=dict, description="Scalars expressions read, by name (passed as aux={name: number})."
    )

    @field_validator("mask", "score_mod", mode="before")
    @classmethod
    def _kind_shorthand(cls, value: Any) -> Any:
        """``mask: causal`` is ``mask: {kind: causal}``."""
        return {"kind": value} if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _fold_flat_kinds(cls, data: Any) -> Any:
        """``mask: causal / sliding_window / none`` and ``score_mod: softcap`` are spellings of the flat
        fields; fold them in so each variant has one canonical form."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        mask, mod = data.get("mask"), data.get("score_mod")
        mask = {"kind": mask} if isinstance(mask, str) else mask
        mod = {"kind": mod} if isinstance(mod, str) else mod
        if isinstance(mask, BaseModel):
            mask = mask.model_dump()
        if isinstance(mod, BaseModel):
            mod = mod.model_dump()
        kind = mask.get("kind") if isinstance(mask, dict) else None
        if kind in ("none", "causal", "sliding_window"):
            extra = set(mask) - {"kind", "left", "right"} if kind == "sliding_window" else set(mask) - {"kind"}
            if extra:
                return data  # the field's own validation names the unknown keys
            flat = {"causal": kind == "causal"}
            if kind == "sliding_window":
                flat = {"window_left": mask.get("left"), "window_right": mask.get("right")}
            for name, value in flat.items():
                given = data.get(name)
                # unset is None (or False for causal); note 0 == False, so test identity
                if given is not None and given is not False and given != value:
                    raise ValueError(f"mask: {kind} and {name}={data[name]!r} both given: set the mask once")
                data[name] = value
            data["mask"] = None
        if isinstance(mod, dict) and mod.get("kind") == "softcap" and set(mod) <= {"kind", "cap"}:
            if data.get("softcap") is not None:
                raise ValueError("score_mod: softcap and softcap= both given: set the cap once")
            data["softcap"] = mod.get("cap")
            data["score_mod"] = None
        return data

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
            raise ValueError(
                f"softmax_scale={value} is not allowed: use a finite number > 0, or null for 1/sqrt(head_dim)"
            )
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

    @model_validator(mode="after")
    def _variant_rules(self) -> AttentionSpec:
        """Which mask kinds combine with the flat fields, and names the expressions may use."""
        kind = self.mask.kind if self.mask is not None else None
        if kind == "prefix_lm" and (self.causal or self.window_left is not None or self.window_right is not None):
            raise ValueError(
                "mask: prefix_lm already fixes the visible keys (prefix bidirectional, causal after): "
                "drop causal / window_left / window_right"
            )
        if kind == "chunked" and self.window_right not in (None, 0):
            raise ValueError(f"mask: chunked is causal within each chunk: window_right={self.window_right} conflicts")
        for name in (*self.aux, *self.scalars):
            _check_declared_name(name)
        both = set(self.aux) & set(self.scalars)
        if both:
            raise ValueError(f"{', '.join(sorted(both))} declared both as aux tensor and as scalar")
        for name, aux in self.aux.items():
            if aux.requires_grad and aux.dtype != "float32":
                raise ValueError(f"aux.{name}.requires_grad: an {aux.dtype} tensor has no gradient (float32 only)")
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _canonical_expressions(cls, data: Any, handler: Any) -> AttentionSpec:
        """Expressions are kept as the canonical text of their parsed tree (comments and layout
        dropped), so a spec carries no user text into generated code and equal trees hash equal."""
        from fa4gen.variants import lower  # expressions parse against the declared names

        spec = handler(data)
        lowered = lower(spec)
        read = lowered.score.uses if lowered.score is not None else frozenset()
        for name, aux in spec.aux.items():
            if aux.requires_grad and name not in read:
                raise ValueError(f"aux.{name}.requires_grad: only tensors the score_mod reads have a gradient")
        update = {}
        if lowered.mask is not None and spec.mask.expr != lowered.mask.text:
            update["mask"] = {"kind": "expression", "expr": lowered.mask.text}
        if (
            lowered.score is not None
            and spec.score_mod.kind == "expression"
            and spec.score_mod.expr != lowered.score.text
        ):
            update["score_mod"] = {"kind": "expression", "expr": lowered.score.text}
        return handler({**spec.model_dump(), **update}) if update else spec

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
        chunked = self.mask is not None and self.mask.kind == "chunked"
        return 0 if self.causal or chunked else self.window_right

    @property
    def mask_kind(self) -> str | None:
        """chunked, prefix_lm, document or expression (None: only the flat fields)."""
        return None if self.mask is None else self.mask.kind

    @property
    def is_varlen(self) -> bool:
        return self.mask_kind == "document"

    @property
    def left_bound(self) -> int | None:
        return self.window_left

    @property
    def has_mask(self) -> bool:
        return self.right_bound is not None or self.left_bound is not None or self.mask is not None

    def __hash__(self) -> int:  # aux/scalars are dicts: hash the canonical form instead
        return hash(self.canonical_json())

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
        if self.mask is not None:
            detail = {"chunked": lambda m: f"chunked{m.size}", "expression": lambda m: "mask-expr"}
            parts.append(detail.get(self.mask.kind, lambda m: m.kind)(self.mask))
        if self.score_mod is not None:
            detail = {
                "relative_bias": lambda m: f"relbias{m.max_distance}",
                "expression": lambda m: "mod-expr",
                "alibi": lambda m: "alibi" if m.slopes == "standard" else "alibi-tensor",
            }
            parts.append(detail[self.score_mod.kind](self.score_mod))
        if self.softcap is not None:
            parts.append(f"softcap{self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.return_lse:
            parts.append("lse")
        if self.deterministic:
            parts.append("deterministic")
        return " ".join(parts)


def spec_json_schema() -> dict[str, Any]:
    return AttentionSpec.model_json_schema()
