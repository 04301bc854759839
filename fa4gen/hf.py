"""Attention specs from a Hugging Face transformers ``config.json``, with transformers' semantics.

    specs = fa4gen.hf.specs_from_hf_config("config.json")   # {"sliding_attention": spec, ...}
    fa4gen from-hf config.json --out specs/                    # one YAML per layer type

One spec per distinct attention layer type, keyed by transformers' own layer type names
(``full_attention``, ``sliding_attention``, ``chunked_attention``: the keys of the mask mapping
in each model's forward), each with the values transformers computes with (read from
transformers 5.17's modeling and configuration files, whose defaults apply to fields a config
leaves out):

- a sliding window of W is ``q - k < W`` (``masking_utils.sliding_window_overlay``): the query
  and W - 1 earlier keys, so ``window_left = W - 1`` with ``causal``;
- Llama 4's chunked layers are ``chunked_overlay`` AND causal: ``mask: {kind: chunked, size}``,
  with chunks counted from key 0 of the keys passed (transformers' cache keeps only the last
  ``attention_chunk_size - 1`` keys of a chunked layer, whose chunk boundaries then shift: pass
  the whole cache); its NoPE layers scale queries by
  ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` (an expression score modifier);
- scaling: ``head_dim**-0.5`` (the default), Gemma's ``query_pre_attn_scalar**-0.5``, DeepSeek's
  ``qk_head_dim**-0.5 * mscale**2`` (YaRN ``mscale_all_dim``), MPT's ``attn_config.softmax_scale``;
- Gemma 2's ``attn_logit_softcapping`` (Gemma 3 never passes it to its attention);
- GPT-OSS's per-head sinks; BLOOM's and MPT's ALiBi (their slopes are the paper's for every
  head count, so ``slopes: standard``; their per-key biases differ from ``-slope * |q - k|`` by a
  constant per row, which softmax ignores).

A config that cannot be mapped raises ``HFConfigError`` (a ``ValueError``), one line naming the
field. Nothing here imports transformers or torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fa4gen.spec import MAX_WINDOW, AttentionSpec
from fa4gen.specfile import dump_spec

MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a config.json is a few KiB; this bounds what is parsed
TRANSFORMERS_VERSION = "5.17"  # whose semantics and defaults this module follows
LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3")
MULTIMODAL = {"gemma3": "gemma3_text", "llama4": "llama4_text"}  # outer model_type -> its text_config's
SUPPORTED_MODEL_TYPES = (*LLAMA_LIKE, "gemma2", "gemma3_text", "gpt_oss", "llama4_text", "deepseek_v3", "bloom", "mpt")
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

# transformers' defaults (configuration_<model>.py) for the fields read here, where they are not None
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32},
    "mistral": {
        "max_position_embeddings": 131072,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "sliding_window": 4096,
    },
    "mixtral": {
        "max_position_embeddings": 131072,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
    },
    "qwen2": {
        "max_position_embeddings": 32768,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "max_position_embeddings": 32768,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen2_moe": {
        "max_position_embeddings": 32768,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_hidden_layers": 24,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3_moe": {
        "max_position_embeddings": 32768,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_hidden_layers": 24,
        "use_sliding_window": False,
        "sliding_window": 4096,
    },
    "phi3": {"max_position_embeddings": 4096, "hidden_size": 3072, "num_attention_heads": 32, "num_hidden_layers": 32},
    "gemma2": {
        "max_position_embeddings": 8192,
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 26,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": {
        "max_position_embeddings": 131072,
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 26,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
    "gpt_oss": {
        "max_position_embeddings": 131072,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 36,
        "head_dim": 64,
        "sliding_window": 128,
    },
    "llama4_text": {
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "num_hidden_layers": 48,
        "head_dim": 128,
        "attention_chunk_size": 8192,
        "no_rope_layer_interval": 4,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
    },
    "deepseek_v3": {
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_hidden_layers": 61,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    "bloom": {"hidden_size": 64, "n_head": 8, "n_layer": 2},
    "mpt": {"d_model": 2048, "n_heads": 16, "n_layers": 24},
}


class HFConfigError(ValueError):
    """A config that cannot be mapped: ``str()`` is one line, ``SOURCE: FIELD: problem``."""

    def __init__(self, source: str, field_name: str, problem: str):
        self.source, self.field, self.problem = source, field_name, problem
        super().__init__(f"{source}: {field_name}: {problem}")


@dataclass
class _Layer:
    """One layer's spec fields and, per field, where its value comes from."""

    layer_type: str
    fields: dict[str, Any]
    notes: dict[str, str]  # spec field -> comment


@dataclass
class HFSpec:
    """One layer type's spec and the comment lines saying where each value comes from."""

    name: str
    spec: AttentionSpec
    layers: list[int]
    notes: list[str] = field(default_factory=list)

    def yaml(self) -> str:
        """The spec file: a header comment, then ``dump_spec``'s YAML."""
        lines = []
        for note in self.notes:
            wrapped = textwrap.wrap(_comment(note), width=98, subsequent_indent="  ", break_on_hyphens=False)
            lines.extend(f"# {line}\n" for line in wrapped or [""])
        return "".join(lines) + dump_spec(self.spec)


# ----------------------------------------------------------------------------- public API
def specs_from_hf_config(config: dict | str | os.PathLike) -> dict[str, AttentionSpec]:
    """One spec per distinct attention layer type of a transformers config (a dict, or the path
    of a config.json), keyed by the layer type (``full_attention`` / ``sliding_attention`` /
    ``chunked_attention``)."""
    return {name: item.spec for name, item in hf_specs(config).items()}


def hf_specs(config: dict | str | os.PathLike) -> dict[str, HFSpec]:
    """Like ``specs_from_hf_config``, with each spec's layers and provenance comments."""
    data, source = _load(config)
    return _Mapper(data, source).specs()


def write_hf_specs(config: dict | str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write one spec YAML per layer type into ``out_dir`` (created if missing) as
    ``<model_type>-<layer-type>.yaml``; returns the paths."""
    data, source = _load(config)
    specs = _Mapper(data, source).specs()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = _file_word(str(data.get("model_type")))
    paths = []
    for name, item in specs.items():
        path = out / f"{stem}-{_file_word(name)}.yaml"
        path.write_text(item.yaml())
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- loading
def _load(config: dict | str | os.PathLike) -> tuple[dict, str]:
    if isinstance(config, dict):
        return config, "config"
    path = Path(config)
    source = str(path)
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise HFConfigError(source, "file", f"larger than {MAX_CONFIG_BYTES // 2**20} MiB: not a config.json")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise HFConfigError(source, "file", " ".join(str(exc).split())) from None
    except json.JSONDecodeError as exc:
        raise HFConfigError(source, "file", f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict):
        raise HFConfigError(source, "file", f"a config.json holds a JSON object, not {type(data).__name__}")
    return data, source


def _show(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    text = text.encode("ascii", "backslashreplace").decode()
    return text if len(text) <= 60 else text[:57] + "..."


def _comment(text: str) -> str:
    """One printable ASCII line (config values are echoed in comments)."""
    text = text.encode("ascii", "backslashreplace").decode()
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _file_word(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text.replace("_", "-")).strip("-.")[:60] or "model"


def _layer_list(layers: list[int], total: int) -> str:
    if len(layers) == total:
        return f"all {total} layers"
    shown = ", ".join(str(i) for i in layers[:8]) + (", ..." if len(layers) > 8 else "")
    return f"layers {shown} ({len(layers)} of {total})"


# ----------------------------------------------------------------------------- mapping
class _Mapper:
    def __init__(self, data: dict, source: str):
        self.source = source
        self.outer = data
        model_type = data.get("model_type")
        if not isinstance(model_type, str):
            raise HFConfigError(source, "model_type", f"missing or not a string ({_show(model_type)})")
        self.outer_type = model_type
        self.prefix = ""
        if model_type in MULTIMODAL:
            text = data.get("text_config")
            if text is None:
                text = {}
            if not isinstance(text, dict):
                raise HFConfigError(source, "text_config", f"expected an object, got {_show(text)}")
            self.cfg = dict(text)
            self.model_type = MULTIMODAL[model_type]
            self.prefix = "text_config."
        elif model_type in SUPPORTED_MODEL_TYPES:
            self.cfg = data
            self.model_type = model_type
        else:
            raise HFConfigError(
                source,
                "model_type",
                f"{_show(model_type)} is not supported: supported are {', '.join(SUPPORTED_MODEL_TYPES)}, "
                f"{', '.join(MULTIMODAL)}",
            )
        self.defaults = DEFAULTS[self.model_type]

    # ---- field access, with transformers' defaults and one-line errors naming the field
    def error(self, name: str, problem: str) -> HFConfigError:
        return HFConfigError(self.source, self.prefix + name, problem)

    def get(self, name: str, default: Any = None) -> Any:
        value = self.cfg.get(name)
        return self.defaults.get(name, default) if value is None and name not in self.cfg else value

    def given(self, name: str) -> bool:
        return name in self.cfg

    def int_(self, name: str, default: Any = None, minimum: int = 1, optional: bool = False) -> int | None:
        value = self.get(name, default)
        if value is None and optional:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"expected an integer, got {_show(value)}")
        if value < minimum:
            raise self.error(name, f"{value} is not allowed: at least {minimum}")
        return value

    def float_(self, name: str, default: Any = None, optional: bool = False) -> float | None:
        value = self.get(name, default)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(name, f"expected a finite number, got {_show(value)}")
        return float(value)

    def bool_(self, name: str, default: bool = False) -> bool:
        value = self.get(name, default)
        if value is None:
            return False
        if isinstance(value, (bool, int)):
            return bool(value)
        raise self.error(name, f"expected true or false, got {_show(value)}")

    # ---- the common fields
    def layer_count(self, name: str = "num_hidden_layers") -> int:
        return self.int_(name)

    def heads(self, name: str = "num_attention_heads") -> int:
        return self.int_(name)

    def gqa(self, heads: int, heads_name: str = "num_attention_heads") -> tuple[int, str]:
        kv = self.int_("num_key_value_heads", optional=True)
        if kv is None:
            return 1, f"qhead_per_kvhead: 1 ({heads_name} = {heads}, num_key_value_heads not set: as many)"
        if heads % kv:
            raise self.error("num_key_value_heads", f"{kv} does not divide {heads_name}={heads}")
        return heads // kv, f"qhead_per_kvhead: {heads // kv} = {heads_name} / num_key_value_heads ({heads} / {kv})"

    def head_dim(
        self,
        heads: int,
        hidden_name: str = "hidden_size",
        heads_name: str = "num_attention_heads",
        explicit: bool = True,
    ) -> tuple[int, str, str]:
        """(head_dim, the field it comes from, note): config.head_dim, else hidden_size // heads."""
        value = self.get("head_dim") if explicit else None
        if value:
            return self.int_("head_dim"), "head_dim", "head_dim: {} = head_dim"
        hidden = self.int_(hidden_name)
        if hidden % heads:
            raise self.error(hidden_name, f"{hidden} is not a multiple of {heads_name}={heads}")
        return hidden // heads, hidden_name, f"head_dim: {{}} = {hidden_name} / {heads_name} ({hidden} / {heads})"

    def dtype(self) -> tuple[str, str]:
        found = None
        for prefix, cfg in ((self.prefix, self.cfg), ("", self.outer)) if self.prefix else (("", self.outer),):
            for name in ("dtype", "torch_dtype"):
                if cfg.get(name) is not None:
                    found = (prefix + name, cfg[name])
                    break
            if found:
                break
        if found is None:
            return "bfloat16", "dtype: bfloat16 (the config gives no dtype / torch_dtype)"
        name, value = found
        text = value.lower().removeprefix("torch.") if isinstance(value, str) else None
        if text in ("bfloat16", "bf16"):
            return "bfloat16", f"dtype: bfloat16 = {name}"
        if text in ("float16", "fp16", "half"):
            return "float16", f"dtype: float16 = {name}"
        if text in ("float32", "fp32", "float", "auto"):
            return "bfloat16", f"dtype: bfloat16 ({name} is {text}: fa4gen kernels take bfloat16 or float16)"
        raise HFConfigError(self.source, name, f"{_show(value)} is not supported: use bfloat16 or float16")

    def window(self, name: str = "sliding_window") -> tuple[int | None, str]:
        size = self.int_(name, optional=True)
        if size is None:
            raise self.error(name, "sliding layers need a window, but it is not set")
        if size - 1 > MAX_WINDOW:
            return None, f"no window ({name} = {size} is past any sequence fa4gen indexes)"
        positions = self.int_("max_position_embeddings", optional=True)
        if positions is not None and size >= positions:
            return None, (
                f"no window: {name} = {size} >= max_position_embeddings = {positions}, so q - k < {name} holds for "
                "every pair of the model's positions"
            )
        return size - 1, f"window_left: {size - 1} = {name} - 1 (transformers masks q - k < {name} = {size})"

    def check_causal(self) -> None:
        if self.given("is_causal") and self.cfg["is_causal"] is False:
            raise self.error("is_causal", "false (bidirectional attention) is not mapped: decoder configs only")
        if self.bool_("use_bidirectional_attention"):
            raise self.error("use_bidirectional_attention", "true is not mapped: decoder (causal) configs only")

    def layer_types(self, count: int, default: list[str]) -> list[str]:
        given = self.get("layer_types")
        if given is None:
            return default
        if not isinstance(given, list) or len(given) < count or not all(isinstance(t, str) for t in given):
            raise self.error("layer_types", f"expected a list of {count} layer type names, got {_show(given)}")
        unknown = sorted(set(given[:count]) - set(LAYER_TYPES))
        if unknown:
            raise self.error(
                "layer_types", f"{_show(unknown[0])} is not supported: fa4gen maps {', '.join(LAYER_TYPES)}"
            )
        return list(given[:count])

    # ---- families
    def specs(self) -> dict[str, HFSpec]:
        self.check_causal()
        dtype, dtype_note = self.dtype()
        layers = getattr(self, "_" + self.model_type if self.model_type not in LLAMA_LIKE else "_llama_like")()
        total = len(layers)
        groups: dict[str, list[tuple[int, _Layer]]] = {}
        for index, layer in enumerate(layers):
            groups.setdefault(layer.layer_type, []).append((index, layer))
        out = {}
        for name, members in groups.items():
            first = members[0][1]
            for _, other in members[1:]:
                if other.fields != first.fields:  # pragma: no cover - every family keys by what differs
                    raise self.error("layer_types", f"layers of type {name} differ: not one spec")
            fields = {**first.fields, "dtype": dtype}
            try:
                spec = AttentionSpec(**fields)
            except ValidationError as exc:
                error = exc.errors(include_url=False)[0]
                message = " ".join(error["msg"].removeprefix("Value error, ").split())
                # the config field behind the spec field (a model-level check names its fields)
                spec_field = (
                    str(error["loc"][0])
                    if error["loc"]
                    else next((name for name in ("softcap", "softmax_scale") if f": {name} " in message), "spec")
                )
                raise self.error(first.notes.get(spec_field + "@field", spec_field), message) from None
            except ValueError as exc:
                raise self.error("config", " ".join(str(exc).split())) from None
            indices = [index for index, _ in members]
            architectures = self.outer.get("architectures")
            header = self.outer.get("_name_or_path") or (
                architectures[0] if isinstance(architectures, list) and architectures else None
            )
            title = f"{header} ({self.outer_type})" if isinstance(header, str) and header else self.outer_type
            notes = [
                f"{title}: {name}, {_layer_list(indices, total)}.",
                f"From a transformers config.json by `fa4gen from-hf` (transformers {TRANSFORMERS_VERSION} semantics).",
                *(note for key, note in first.notes.items() if not key.endswith("@field")),
                dtype_note,
            ]
            out[name] = HFSpec(name=name, spec=spec, layers=indices, notes=notes)
        return out

    def _base(
        self,
        heads: int,
        head_dim: int,
        dim_field: str,
        dim_note: str,
        ratio: int,
        ratio_note: str,
        layer_type: str = "full_attention",
    ) -> _Layer:
        return _Layer(
            layer_type=layer_type,
            fields={"head_dim": head_dim, "qhead_per_kvhead": ratio, "causal": True},
            notes={
                "head_dim": dim_note.format(head_dim),
                "head_dim@field": dim_field,
                "qhead_per_kvhead": ratio_note,
                "causal": "causal: true (decoder self-attention: transformers' causal_mask_function, kv_idx <= q_idx)",
            },
        )

    def _with_window(self, layer: _Layer, name: str = "sliding_window") -> _Layer:
        left, note = self.window(name)
        fields = dict(layer.fields)
        if left is not None:
            fields["window_left"] = left
        return _Layer("sliding_attention", fields, {**layer.notes, "window_left": note, "window_left@field": name})

    def _scaled(self, layer: _Layer, scale: float, note: str, field_name: str) -> _Layer:
        default = 1.0 / math.sqrt(layer.fields["head_dim"])
        if math.isclose(scale, default, rel_tol=1e-12):
            return _Layer(
                layer.layer_type,
                layer.fields,
                {**layer.notes, "softmax_scale": f"{note} = 1/sqrt(head_dim), the default"},
            )
        return _Layer(
            layer.layer_type,
            {**layer.fields, "softmax_scale": scale},
            {**layer.notes, "softmax_scale": note, "softmax_scale@field": field_name},
        )

    def _llama_like(self) -> list[_Layer]:
        """Llama, Mistral, Mixtral, Qwen 2/3 and their MoE models, Phi-3: scaling head_dim**-0.5;
        Mistral, Mixtral and Phi-3 use one mask for every layer (a window when sliding_window is
        set); the Qwens slide only with use_sliding_window: Qwen 2/3 on layers from
        max_window_layers on, Qwen2-MoE on even layers below it (or as layer_types says), Qwen3-MoE
        on every layer (it has no layer_types)."""
        count = self.layer_count()
        heads = self.heads()
        ratio, ratio_note = self.gqa(heads)
        head_dim, dim_field, dim_note = self.head_dim(heads)
        base = self._base(heads, head_dim, dim_field, dim_note, ratio, ratio_note)
        base.notes["softmax_scale"] = "softmax_scale: head_dim**-0.5, the default"
        if self.model_type == "llama":
            return [base] * count
        if self.model_type in ("mistral", "mixtral", "phi3"):
            if self.get("sliding_window") is None:
                base.notes["window_left"] = "no window (sliding_window is null)"
                return [base] * count
            return [self._with_window(base)] * count
        # the Qwens: their configurations drop sliding_window unless use_sliding_window
        use = self.bool_("use_sliding_window")
        window = self.get("sliding_window") if use else None
        if self.model_type == "qwen3_moe":  # (its attention reads sliding_window on every layer)
            types = ["sliding_attention" if window is not None else "full_attention"] * count
        else:
            start = self.int_("max_window_layers", minimum=0)
            if self.model_type == "qwen2_moe":
                default = [
                    "sliding_attention" if use and i % 2 == 0 and i < start else "full_attention" for i in range(count)
                ]
            else:
                default = [
                    "sliding_attention" if window is not None and i >= start else "full_attention" for i in range(count)
                ]
            types = self.layer_types(count, default)
        out = []
        for layer_type in types:
            if layer_type == "sliding_attention":
                if not use:
                    raise self.error("use_sliding_window", "false, but layer_types has sliding_attention layers")
                out.append(self._with_window(base))
            elif layer_type == "full_attention":
                out.append(base)
            else:
                raise self.error("layer_types", f"{layer_type} is not a {self.model_type} layer type")
        if not use and self.given("sliding_window") and self.cfg["sliding_window"] is not None:
            base.notes["window_left"] = "no window (use_sliding_window is false, so transformers drops sliding_window)"
        return out

    def _gemma(self, softcap: bool) -> list[_Layer]:
        count = self.layer_count()
        heads = self.heads()
        ratio, ratio_note = self.gqa(heads)
        head_dim, dim_field, dim_note = self.head_dim(heads)
        base = self._base(heads, head_dim, dim_field, dim_note, ratio, ratio_note)
        scalar = self.float_("query_pre_attn_scalar")
        if scalar <= 0:
            raise self.error("query_pre_attn_scalar", f"{scalar} is not allowed: use a number > 0")
        base = self._scaled(
            base,
            scalar**-0.5,
            f"softmax_scale: query_pre_attn_scalar**-0.5 ({_show(self.get('query_pre_attn_scalar'))}**-0.5)",
            "query_pre_attn_scalar",
        )
        cap = self.float_("attn_logit_softcapping", optional=True)
        if softcap and cap is not None:
            if cap <= 0:
                raise self.error("attn_logit_softcapping", f"{cap} is not allowed: use a number > 0")
            base = _Layer(
                base.layer_type,
                {**base.fields, "softcap": cap},
                {
                    **base.notes,
                    "softcap": f"softcap: {cap:g} = attn_logit_softcapping",
                    "softcap@field": "attn_logit_softcapping",
                },
            )
        elif cap is not None:
            base.notes["softcap"] = (
                f"no softcap (attn_logit_softcapping = {cap:g} is not passed to Gemma 3's attention by transformers)"
            )
        if self.model_type == "gemma2":
            default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(count)]
        else:
            pattern = self.int_("sliding_window_pattern")
            default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(count)]
        types = self.layer_types(count, default)
        sliding = self._with_window(base) if "sliding_attention" in types else None
        out = []
        for layer_type in types:
            if layer_type == "chunked_attention":
                raise self.error("layer_types", f"chunked_attention is not a {self.model_type} layer type")
            out.append(sliding if layer_type == "sliding_attention" else base)
        return out

    def _gemma2(self) -> list[_Layer]:
        return self._gemma(softcap=True)

    def _gemma3_text(self) -> list[_Layer]:
        return self._gemma(softcap=False)

    def _gpt_oss(self) -> list[_Layer]:
        count = self.layer_count()
        heads = self.heads()
        ratio, ratio_note = self.gqa(heads)
        head_dim, dim_field, dim_note = self.head_dim(heads)
        base = self._base(heads, head_dim, dim_field, dim_note, ratio, ratio_note)
        base.fields["sinks"] = True
        base.notes["softmax_scale"] = (
            "softmax_scale: head_dim**-0.5, the default (YaRN scales the rotary table, not q.k)"
        )
        base.notes["sinks"] = (
            "sinks: true (GptOssAttention.sinks, float32 (num_attention_heads,): pass the layer's sinks as sinks=)"
        )
        default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(count)]
        types = self.layer_types(count, default)
        sliding = self._with_window(base) if "sliding_attention" in types else None
        out = []
        for layer_type in types:
            if layer_type == "chunked_attention":
                raise self.error("layer_types", "chunked_attention is not a gpt_oss layer type")
            out.append(sliding if layer_type == "sliding_attention" else base)
        return out

    def _llama4_text(self) -> list[_Layer]:
        count = self.layer_count()
        heads = self.heads()
        ratio, ratio_note = self.gqa(heads)
        head_dim, dim_field, dim_note = self.head_dim(heads)
        base = self._base(heads, head_dim, dim_field, dim_note, ratio, ratio_note)
        interval = self.int_("no_rope_layer_interval")
        no_rope = self.get("no_rope_layers")
        if not no_rope:  # transformers: an empty list or None takes the interval's
            no_rope = [int((i + 1) % interval != 0) for i in range(count)]
        elif not isinstance(no_rope, list) or len(no_rope) < count or not all(v in (0, 1) for v in no_rope):
            raise self.error("no_rope_layers", f"expected a list of {count} 0/1 flags, got {_show(no_rope)}")
        types = self.layer_types(count, ["chunked_attention" if flag else "full_attention" for flag in no_rope])
        tuning = self.bool_("attn_temperature_tuning")
        floor_scale = self.int_("floor_scale")
        attn_scale = self.float_("attn_scale")
        out = []
        for layer_type, uses_rope in zip(types, no_rope):
            layer = _Layer(layer_type, dict(base.fields), dict(base.notes))
            if layer_type == "sliding_attention":
                raise self.error("layer_types", "sliding_attention is not a llama4 layer type")
            if layer_type == "chunked_attention":
                size = self.int_("attention_chunk_size", optional=True)
                if size is None:
                    raise self.error("attention_chunk_size", "chunked layers need a chunk size, but it is not set")
                layer.fields.pop("causal")
                layer.fields["mask"] = {"kind": "chunked", "size": size}
                layer.notes.pop("causal")
                layer.notes["mask"] = (
                    f"mask: chunked, size {size} = attention_chunk_size (chunked_overlay AND causal; "
                    "chunks counted from the first key passed: pass the whole cache)"
                )
                layer.notes["mask@field"] = "attention_chunk_size"
            if tuning and not uses_rope:
                factor = f"(log(1.0 + (q_idx + (seqlen_k - seqlen_q) + 1) // {floor_scale}) * {attn_scale!r} + 1.0)"
                layer.fields["score_mod"] = {"kind": "expression", "expr": f"score * {factor}"}
                layer.notes["score_mod"] = (
                    f"score_mod: NoPE temperature tuning (attn_temperature_tuning; floor_scale = {floor_scale}, "
                    f"attn_scale = {attn_scale!r}): q scaled by "
                    "log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1, "
                    "pos = q_idx + seqlen_k - seqlen_q (the whole cache passed)"
                )
                if layer_type != "full_attention":
                    layer.layer_type = layer_type + "_nope"
            elif layer_type == "full_attention" and tuning:
                layer.layer_type = "full_attention_rope"
            out.append(layer)
        return out

    def _deepseek_v3(self) -> list[_Layer]:
        count = self.layer_count()
        heads = self.heads()
        nope = self.int_("qk_nope_head_dim", minimum=0)
        rope = self.int_("qk_rope_head_dim", minimum=0)
        head_dim_v = self.int_("v_head_dim")
        qk = nope + rope
        layer = _Layer(
            "full_attention",
            {"head_dim": qk, "head_dim_v": head_dim_v, "qhead_per_kvhead": 1, "causal": True},
            {
                "head_dim": f"head_dim: {qk} = qk_nope_head_dim + qk_rope_head_dim ({nope} + {rope})",
                "head_dim@field": "qk_nope_head_dim",
                "head_dim_v": f"head_dim_v: {head_dim_v} = v_head_dim",
                "head_dim_v@field": "v_head_dim",
                "qhead_per_kvhead": f"qhead_per_kvhead: 1 (MLA: kv_b_proj expands keys and values to all "
                f"{heads} num_attention_heads)",
                "causal": "causal: true (decoder self-attention: transformers' causal_mask_function, kv_idx <= q_idx)",
            },
        )
        rope_field = "rope_parameters" if self.cfg.get("rope_parameters") is not None else "rope_scaling"
        params = self.cfg.get(rope_field) or {}
        if not isinstance(params, dict):
            raise self.error(rope_field, f"expected an object, got {_show(params)}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        scale = qk ** (-0.5)  # DeepseekV3Attention: yarn_apply_mscale(rope_parameters, qk_head_dim ** (-0.5))
        note = f"softmax_scale: qk_head_dim**-0.5 ({qk}**-0.5)"
        mscale_all_dim = params.get("mscale_all_dim", 0) if rope_type != "default" else 0
        if mscale_all_dim:
            factor = params.get("factor")
            for name, value in (("mscale_all_dim", mscale_all_dim), ("factor", factor)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise self.error(f"{rope_field}.{name}", f"expected a finite number, got {_show(value)}")
            mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
            note = (
                f"softmax_scale: qk_head_dim**-0.5 * mscale**2, mscale = 0.1 * {rope_field}.mscale_all_dim * "
                f"ln({rope_field}.factor) + 1 = 0.1 * {mscale_all_dim!r} * ln({factor!r}) + 1 = {mscale!r} "
                f"(YaRN, rope_type {rope_type})"
            )
        layer = self._scaled(layer, scale, note, rope_field)
        return [layer] * count

    def _alibi_layers(
        self, heads: int, head_dim: int, dim_field: str, dim_note: str, heads_name: str, count: int
    ) -> list[_Layer]:
        layer = self._base(
            heads, head_dim, dim_field, dim_note, 1, f"qhead_per_kvhead: 1 ({heads_name} query, key and value heads)"
        )
        layer.fields["score_mod"] = {"kind": "alibi", "slopes": "standard"}
        layer.notes["score_mod"] = (
            f"score_mod: alibi, standard slopes for the {heads_name} heads (transformers' "
            f"{'build_alibi_tensor' if self.model_type == 'bloom' else 'build_mpt_alibi_tensor (alibi_bias_max 8)'} "
            "gives the paper's slopes; its per-key bias differs from -slope * |q - k| by a constant per row)"
        )
        return [layer] * count

    def _bloom(self) -> list[_Layer]:
        count = self.layer_count("n_layer") if not self.given("num_hidden_layers") else self.layer_count()
        heads_name = "num_attention_heads" if self.given("num_attention_heads") else "n_head"
        heads = self.heads(heads_name)
        hidden_name = "n_embed" if self.given("n_embed") and self.cfg["n_embed"] is not None else "hidden_size"
        head_dim, dim_field, dim_note = self.head_dim(heads, hidden_name, heads_name, explicit=False)
        layers = self._alibi_layers(heads, head_dim, dim_field, dim_note, heads_name, count)
        layers[0].notes["softmax_scale"] = (
            "softmax_scale: 1/sqrt(head_dim) (BloomAttention.inv_norm_factor), the default"
        )
        return layers

    def _mpt(self) -> list[_Layer]:
        count = self.layer_count("n_layers")
        heads = self.heads("n_heads")
        head_dim, dim_field, dim_note = self.head_dim(heads, "d_model", "n_heads", explicit=False)
        layers = self._alibi_layers(heads, head_dim, dim_field, dim_note, "n_heads", count)
        attn = self.cfg.get("attn_config") or {}
        if not isinstance(attn, dict):
            raise self.error("attn_config", f"expected an object, got {_show(attn)}")
        scale = attn.get("softmax_scale")
        if scale is None:
            layers = [
                self._scaled(
                    layers[0],
                    1 / math.sqrt(head_dim),
                    "softmax_scale: 1/sqrt(d_model / n_heads) (attn_config.softmax_scale is null)",
                    "attn_config.softmax_scale",
                )
            ] * count
        else:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
                raise self.error("attn_config.softmax_scale", f"expected a finite number > 0, got {_show(scale)}")
            layers = [
                self._scaled(
                    layers[0], float(scale), "softmax_scale: attn_config.softmax_scale", "attn_config.softmax_scale"
                )
            ] * count
        if attn.get("alibi") is False or attn.get("alibi_bias_max", 8) != 8:
            layers[0].notes["score_mod"] += (
                f"; attn_config.alibi = {_show(attn.get('alibi'))}, "
                f"alibi_bias_max = {_show(attn.get('alibi_bias_max'))} "
                "are not read by transformers' MPT, which always adds ALiBi with alibi_bias_max 8"
            )
        return layers
