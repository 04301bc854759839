"""fa4gen kernels behind Hugging Face transformers' attention interface: ``attn_implementation="fa4gen"``.

    from fa4gen.integrations import transformers as fa4gen_transformers

    fa4gen_transformers.register()                   # once per process (idempotent)
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa4gen", dtype=torch.bfloat16)

``register()`` adds an attention function and an attention-mask function named "fa4gen" to
transformers' ``AttentionInterface`` and ``AttentionMaskInterface``. Each attention layer then
runs the spec ``fa4gen.hf`` maps its model config to for its layer type
(``config.layer_types[layer_idx]``), checked against what the layer passes (scaling,
sliding_window, softcap, sinks as ``s_aux``, head counts and dims, causality) and given the
tensors' dtype. Kernels are compiled (or loaded from the disk cache) on their first call through
``fa4gen.ops.attention``, a torch custom op, so a model compiles under
``torch.compile(fullgraph=True)``; each distinct spec is built once per process.

Inputs:

- no padding: the dense kernel on (B, S, H, D) views of the layer's tensors (no copies, no
  data-dependent operations). Fewer queries than keys (a DynamicCache, sliding layers' caches of
  W - 1 keys included) align causal masks and windows to the end of the keys, as transformers does.
- a 2D ``attention_mask`` with padding: each row becomes two packed documents (its padding, then
  its tokens, in their order) for the document-mask variant of the spec; padded query rows come
  back as zeros, as from transformers' flash-attention path. Shapes stay static: left-padded rows
  (generate's layout) are used in place, other layouts are reordered with a stable sort per row.
  In eager mode a mask without padding, or every row left-padded, is found once per forward pass
  (one device sync per layer type). Padding between a row's tokens packs them together, so a
  sliding window counts tokens rather than positions there (as in the flash-attention path).
- packed sequences: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keywords (DataCollatorWithFlattening with
  ``return_flash_attn_kwargs=True``) run the document variant, also under torch.compile.
  ``position_ids`` that restart (a step other than +1, as transformers' masks read them) are read in
  eager mode only, since finding the documents needs a device sync: under torch.compile pass the
  ``cu_seq_lens`` keywords. Packing applies where queries and keys have the same length.

torch.compile(fullgraph=True, dynamic=True) traces all three without graph breaks; the mapping
and the checks run while Dynamo traces, never in the graph. ``kernel_specs(config)`` lists every
spec a model runs, to warm a kernel cache before deploying.

Everything else falls back to transformers' own attention, with one ``FallbackWarning`` per
distinct reason naming the model type, the layer type and why: SDPA, or the model's eager
attention where SDPA would drop what the layer needs (softcap, sinks, attention weights).
Fallbacks: tensors not on a CUDA GPU, float32 tensors, a GPU other than Hopper, gradients
(the kernels are forward only), attention dropout, ``output_attentions=True``, a 4D attention mask
(a custom mask, or a static cache's full layers, whose preallocated keys run past the tokens
seen), configs ``fa4gen.hf`` cannot map (unsupported model types or head dims), chunked layers
(Llama 4: the cache keeps only the last chunk - 1 keys, so the chunk boundaries the kernel counts
move), and a layer whose arguments differ from its config's spec. For configs that cannot run on
kernels the mask function returns transformers' SDPA mask, so those fallbacks see exactly SDPA's
inputs.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

import fa4gen.ops
from fa4gen.arch import UnsupportedArchError, detect_arch
from fa4gen.handles import live_object
from fa4gen.hf import HFConfigError, hf_specs
from fa4gen.spec import AttentionSpec

NAME = "fa4gen"
DTYPES = ("bfloat16", "float16")
# what the kernel path takes; tests widen both to run the glue on CPU against a reference kernel
_KERNEL_DTYPES: dict[Any, str] = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_KERNEL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
_CHUNKED_PROBLEM = (
    "chunked_attention layers are not run on kernels: transformers' cache keeps only the last "
    "attention_chunk_size - 1 keys, which moves the chunk boundaries fa4gen counts from the first key"
)


class FallbackWarning(UserWarning):
    """A layer runs on transformers' own attention instead of fa4gen kernels (once per reason)."""


@dataclass(frozen=True)
class LayerKernels:
    """The specs one attention layer type of a model runs, per (dtype, packed): ``packed`` is the
    document-mask variant that padded batches and packed sequences run."""

    layer_type: str
    spec: AttentionSpec  # as fa4gen.hf maps the config
    variants: dict[tuple[str, bool], AttentionSpec]
    packed_problem: str | None = None


@dataclass(frozen=True)
class _Model:
    config: Any  # a weak reference to the config (None for a dict)
    model_type: str
    problem: str | None  # why no layer of this model runs on kernels
    layers: dict[int, LayerKernels] = field(default_factory=dict)
    types: dict[str, LayerKernels] = field(default_factory=dict)


class _Call(NamedTuple):
    """One call of the attention function, as transformers makes it."""

    module: Any
    query: torch.Tensor  # (B, Hq, Sq, D)
    key: torch.Tensor  # (B, Hkv, Sk, D)
    value: torch.Tensor  # (B, Hkv, Sk, Dv)
    attention_mask: torch.Tensor | None
    dropout: float
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    s_aux: torch.Tensor | None
    is_causal: bool | None
    kwargs: dict


# ----------------------------------------------------------------------------- public API
def register(name: str = NAME) -> str:
    """Register fa4gen's attention and attention-mask functions with transformers under ``name``
    (idempotent); returns the name to pass as ``attn_implementation``."""
    AttentionInterface.register(name, fa4gen_attention)
    AttentionMaskInterface.register(name, fa4gen_mask)
    return name


def kernel_specs(config, dtypes: tuple[str, ...] = ("bfloat16",)) -> dict[str, AttentionSpec]:
    """Every spec the integration runs for a model config (a transformers config or its
    ``to_dict()``), keyed ``LAYER_TYPE/DTYPE`` (dense inputs) and ``LAYER_TYPE/DTYPE/packed``
    (padded batches, packed sequences): what to warm a cache with before deploying. Raises
    ValueError, one line, where the model's layers would fall back instead."""
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise ValueError(f"dtype {unknown[0]!r} is not supported: use {' or '.join(DTYPES)}")
    model = _map_model(config)
    if model.problem is not None:
        raise ValueError(f"{model.model_type}: {model.problem}")
    specs = {}
    for name, layer in model.types.items():
        for dtype in dtypes:
            for packed in (False, True):
                spec = layer.variants.get((dtype, packed))
                if spec is not None:
                    specs[f"{name}/{dtype}" + ("/packed" if packed else "")] = spec
    return specs


def fa4gen_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function registered as "fa4gen": query (B, Hq, Sq, D), key and value
    (B, Hkv, Sk, D) -> (output (B, Sq, Hq, Dv), None), on a kernel or, where the kernels do not
    apply, on transformers' SDPA / eager attention (then with its attention weights)."""
    call = _Call(
        module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, s_aux, is_causal, kwargs
    )
    config = getattr(module, "config", None)
    model = _model_of(config) if config is not None else None
    layer, problem = _layer_of(model, module)
    if problem is None:
        problem = _input_problem(call) or _spec_problem(layer.spec, call) or _mask_problem(call)
    if problem is not None:
        return _fallback(problem, model, layer, call)
    docs = _packed_docs(call)
    packed = attention_mask is not None or docs is not None
    spec = layer.variants.get((_KERNEL_DTYPES[query.dtype], packed))
    if spec is None:
        return _fallback(layer.packed_problem, model, layer, call)
    return _run(spec, call, docs), None


def fa4gen_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The attention-mask function registered as "fa4gen": None without padding, else the 2D
    (B, kv_length) padding mask of the layer's keys (like transformers' flash-attention mask);
    transformers' 4D SDPA mask where the kernels do not apply (configs fa4gen cannot map, custom
    mask functions, static caches whose keys run past the tokens seen), which the attention
    function then hands to SDPA."""
    config = kwargs.get("config")
    ours = config is not None and _model_of(config).problem is None
    narrow = attention_mask is not None and attention_mask.shape[-1] < kv_length
    custom = bool(kwargs.get("use_vmap")) or narrow or _keys_past_queries(q_length, kv_length, q_offset, kv_offset)
    if not ours or custom:
        if custom:  # never None: the attention function would read it as "no padding" and run a kernel
            kwargs = {**kwargs, "allow_is_causal_skip": False}
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            **kwargs,
        )
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]  # sliding layers' caches hold only the last keys
    if not torch.compiler.is_compiling() and bool(mask.all()):
        return None
    return mask


# ----------------------------------------------------------------------------- config -> specs
_MODELS: dict[int, _Model] = {}


def _model_of(config) -> _Model:
    """The model's mapping, made once per config object and process."""
    if torch.compiler.is_compiling():
        return _MODELS[_traced_key(id(config))]
    return _MODELS[_mapped_key(config)]


def _mapped_key(config) -> int:
    key = id(config)
    model = _MODELS.get(key)
    if model is None or model.config is None or model.config() is not config:
        for stale in [k for k, m in _MODELS.items() if m.config is not None and m.config() is None]:
            del _MODELS[stale]
        _MODELS[key] = _map_model(config)
    return key


@torch.compiler.assume_constant_result
def _traced_key(key: int) -> int:
    """``_mapped_key`` for torch.compile, which runs this while tracing (so the mapping never
    runs in a graph) and passes it only constants: the config's id, not the config (torch 2.11
    converts every argument with as_python_constant)."""
    model = _MODELS.get(key)
    if model is not None and model.config is not None and id(model.config()) == key:
        return key
    # Dynamo took the id of the config of the module it is tracing, which holds the config: the
    # object is alive, so its id is its address
    return _mapped_key(live_object(key))


def _map_model(config) -> _Model:
    if not isinstance(config, dict) and not callable(getattr(config, "to_dict", None)):
        return _Model(None, type(config).__name__, "the attention module's config is not a transformers config")
    data = config if isinstance(config, dict) else config.to_dict()
    ref = None if isinstance(config, dict) else weakref.ref(config)
    # the tensors' dtype picks the kernel, whatever dtype the config was saved in
    data = {name: value for name, value in data.items() if name not in ("dtype", "torch_dtype")}
    model_type = str(data.get("model_type"))
    try:
        mapped = hf_specs(data)
    except HFConfigError as exc:
        return _Model(ref, model_type, f"fa4gen.hf cannot map the config ({exc})")
    if any(name.startswith("chunked_attention") for name in mapped):
        return _Model(ref, model_type, _CHUNKED_PROBLEM)
    types = {name: _layer_kernels(name, item.spec) for name, item in mapped.items()}
    layers = {index: types[name] for name, item in mapped.items() for index in item.layers}
    return _Model(ref, model_type, None, layers, types)


def _layer_kernels(layer_type: str, spec: AttentionSpec) -> LayerKernels:
    variants: dict[tuple[str, bool], AttentionSpec] = {}
    problem = None
    for dtype in DTYPES:
        fields = {**spec.model_dump(), "dtype": dtype}
        variants[(dtype, False)] = AttentionSpec.model_validate(fields)
        if spec.mask is not None:
            problem = f"padded or packed inputs need a document mask, and the spec has a {spec.mask.kind} mask"
            continue
        try:
            variants[(dtype, True)] = AttentionSpec.model_validate({**fields, "mask": {"kind": "document"}})
        except ValueError as exc:  # pydantic's ValidationError is one
            problem = f"padded or packed inputs need a document mask: {' '.join(str(exc).split())}"
    return LayerKernels(layer_type, spec, variants, problem)


def _layer_of(model: _Model | None, module) -> tuple[LayerKernels | None, str | None]:
    if model is None:
        return None, "the attention module has no config"
    if model.problem is not None:
        return None, model.problem
    index = getattr(module, "layer_idx", None)
    layer = model.layers.get(index)
    if layer is None and len(model.types) == 1:  # one layer type: no index needed
        layer = next(iter(model.types.values()))
    if layer is None:
        return None, f"layer index {index} is not among the config's layers"
    return layer, None


# ----------------------------------------------------------------------------- checks
_GPU_PROBLEMS: dict[int, str] = {}


@torch.compiler.assume_constant_result
def _gpu_problem(index: int) -> str:
    """Why GPU ``index`` cannot run the kernels ("" if it can), asked once per device."""
    if index not in _GPU_PROBLEMS:
        try:
            detect_arch(index)
            _GPU_PROBLEMS[index] = ""
        except UnsupportedArchError as exc:
            _GPU_PROBLEMS[index] = str(exc)
    return _GPU_PROBLEMS[index]


def _input_problem(call: _Call) -> str | None:
    query, key, value = call.query, call.key, call.value
    if query.device.type not in _KERNEL_DEVICE_TYPES:
        return f"tensors on {query.device.type}: fa4gen kernels run on CUDA GPUs"
    if query.dtype not in _KERNEL_DTYPES:
        return f"{str(query.dtype).removeprefix('torch.')} tensors: fa4gen kernels take bfloat16 or float16"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return f"query, key and value of different dtypes ({query.dtype}, {key.dtype}, {value.dtype})"
    if call.dropout:
        return f"attention dropout {call.dropout:g}: fa4gen kernels apply none"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return "gradients are needed: fa4gen kernels run the forward pass only"
    if call.kwargs.get("output_attentions"):
        return "output_attentions=True: fa4gen kernels return no attention weights"
    if call.kwargs.get("position_bias") is not None:
        return "a position_bias: fa4gen kernels add no bias tensor"
    if query.shape[0] == 0 or query.shape[2] == 0 or key.shape[2] == 0:
        return "empty inputs"
    if query.device.type == "cuda":
        return _gpu_problem(query.device.index) or None
    return None


def _spec_problem(spec: AttentionSpec, call: _Call) -> str | None:
    """Where the layer's arguments disagree with its config's spec (then the config mapping does
    not describe this layer, and the kernel would compute something else)."""
    query, key, value = call.query, call.key, call.value
    if query.shape[-1] != spec.head_dim or value.shape[-1] != spec.dv:
        return (
            f"head dims q/k {query.shape[-1]}, v {value.shape[-1]}; "
            f"the config gives {spec.head_dim}, {spec.dv} (fa4gen.hf)"
        )
    if query.shape[1] != key.shape[1] * spec.qhead_per_kvhead:
        return (
            f"{query.shape[1]} query heads for {key.shape[1]} key/value heads; "
            f"the config gives {spec.qhead_per_kvhead} per key/value head (fa4gen.hf)"
        )
    scaling = call.scaling if call.scaling is not None else spec.head_dim**-0.5
    if not _close(scaling, spec.scale):
        return f"the layer scales q.k by {scaling:.6g}; fa4gen.hf maps the config to softmax_scale {spec.scale:.6g}"
    if (call.softcap is None) != (spec.softcap is None) or (
        call.softcap is not None and not _close(call.softcap, spec.softcap)
    ):
        return f"the layer passes softcap {call.softcap}; fa4gen.hf maps the config to softcap {spec.softcap}"
    window = None if call.sliding_window is None else call.sliding_window - 1
    # fa4gen.hf drops windows no position reaches; the layer's window must then cover these keys
    no_op = spec.window_left is None and window is not None and window >= key.shape[2] - 1
    if window != spec.window_left and not no_op:
        return (
            f"the layer passes sliding_window {call.sliding_window}; "
            f"fa4gen.hf maps the config to window_left {spec.window_left}"
        )
    if (call.s_aux is not None) != spec.sinks:
        given = "passes" if call.s_aux is not None else "passes no"
        return f"the layer {given} sinks (s_aux); fa4gen.hf maps the config to sinks={spec.sinks}"
    causal = call.is_causal if call.is_causal is not None else getattr(call.module, "is_causal", True)
    if not causal or spec.right_bound != 0:
        return "non-causal attention: fa4gen.hf maps decoder configs to causal specs"
    return None


def _close(value, expected: float) -> bool:
    # plain arithmetic: under torch.compile a module's float attributes may be symbolic
    return abs(value - expected) <= 1e-6 * abs(expected)


def _mask_problem(call: _Call) -> str | None:
    mask = call.attention_mask
    if mask is None:
        return None
    if mask.ndim != 2:
        return (
            "a 4D attention mask (a custom mask, or a static cache whose keys run past the tokens seen): "
            "fa4gen kernels take padding as a 2D mask"
        )
    if mask.shape[0] != call.query.shape[0] or mask.shape[1] != call.key.shape[2]:
        return f"a 2D attention mask of shape {tuple(mask.shape)} for {call.key.shape[2]} keys"
    return None


# ----------------------------------------------------------------------------- the kernel path
def _run(spec: AttentionSpec, call: _Call, docs) -> torch.Tensor:
    """The layer's attention on ``spec``'s kernel: (B, Sq, Hq, Dv)."""
    # (B, S, H, D) views of transformers' (B, H, S, D) tensors: the kernels need only the head
    # dim contiguous
    q, k, v = (t.transpose(1, 2) for t in (call.query, call.key, call.value))
    variant = {"sinks": call.s_aux.to(torch.float32)} if spec.sinks else {}
    if call.attention_mask is not None:
        return _run_padded(spec, q, k, v, call.attention_mask, variant)
    if docs is None:
        return fa4gen.ops.attention(spec, q, k, v, **variant)
    cu_q, cu_k, max_q, max_k = docs
    batch, seqlen = q.shape[:2]
    out = fa4gen.ops.attention(
        spec,
        *(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        **variant,
    )
    return out.view(batch, seqlen, *out.shape[1:])


class _Unpadding(NamedTuple):
    """A padded batch as packed documents: per row its padding, then its tokens."""

    q_order: torch.Tensor | None  # (B, Sq): the query rows in document order (None: already so)
    k_order: torch.Tensor | None  # (B, Sk)
    q_valid: torch.Tensor  # (B, Sq, 1, 1) bool: the query rows that are tokens
    cu_q: torch.Tensor  # int32 (2B + 1,)
    cu_k: torch.Tensor


def _run_padded(spec: AttentionSpec, q, k, v, mask: torch.Tensor, variant: dict) -> torch.Tensor:
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    if torch.compiler.is_compiling():
        plan = _unpadding(mask, seqlen_q)
    else:
        plan = _UNPADDING.get(mask, seqlen_q, lambda: _unpadding(mask, seqlen_q))
    out = fa4gen.ops.attention(
        spec,
        _rows(q, plan.q_order),
        _rows(k, plan.k_order),
        _rows(v, plan.k_order),
        cu_seqlens_q=plan.cu_q,
        cu_seqlens_k=plan.cu_k,
        max_seqlen_q=seqlen_q,  # bounds: they pick the kernel of that length range
        max_seqlen_k=seqlen_k,
        **variant,
    )
    out = out.view(batch, seqlen_q, heads, out.shape[-1])
    if plan.q_order is not None:
        out = torch.empty_like(out).scatter_(1, plan.q_order[:, :, None, None].expand_as(out), out)
    return out.masked_fill(~plan.q_valid, 0)  # padded query rows are zeros, as in transformers' flash path


def _unpadding(mask: torch.Tensor, seqlen_q: int) -> _Unpadding:
    valid_k = mask.bool()
    valid_q = valid_k[:, -seqlen_q:]  # the queries are the last keys
    # left-padded rows (generate's layout) are already padding-then-tokens: no reordering.
    # Finding that out reads the mask on the host, so compiled graphs always reorder.
    in_order = not torch.compiler.is_compiling() and bool((valid_k[:, 1:] >= valid_k[:, :-1]).all())
    k_order = q_order = None
    if not in_order:  # a stable sort moves padding first and keeps the tokens' order
        k_order = torch.argsort(valid_k.to(torch.uint8), dim=1, stable=True)
        q_order = torch.argsort(valid_q.to(torch.uint8), dim=1, stable=True)
    cu_q = _two_documents_per_row(seqlen_q - valid_q.sum(1), seqlen_q)
    cu_k = _two_documents_per_row(valid_k.shape[1] - valid_k.sum(1), valid_k.shape[1])
    return _Unpadding(q_order, k_order, valid_q[:, :, None, None], cu_q, cu_k)


def _two_documents_per_row(pads: torch.Tensor, seqlen: int) -> torch.Tensor:
    """cu_seqlens of rows of ``seqlen`` packed one after another, each a document of its ``pads``
    padding rows and one of its tokens (both aligned to their ends by the kernel)."""
    batch = pads.shape[0]
    starts = torch.arange(batch, device=pads.device) * seqlen
    bounds = torch.stack((starts, starts + pads), dim=1).flatten()
    return torch.cat((bounds, bounds.new_full((1,), batch * seqlen))).to(torch.int32)


def _rows(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """(B, S, H, D) -> packed (B * S, H, D), rows reordered per batch entry by ``order``."""
    if order is not None:
        t = torch.gather(t, 1, order[:, :, None, None].expand(-1, -1, *t.shape[2:]))
    return t.reshape(-1, *t.shape[2:])


def _packed_docs(call: _Call):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of packed sequences, or None."""
    batch, seqlen = call.query.shape[0], call.query.shape[2]
    if call.attention_mask is not None or seqlen != call.key.shape[2]:
        return None
    cu_q, cu_k = call.kwargs.get("cu_seq_lens_q"), call.kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = (_host_int(call.kwargs.get(name)) for name in ("max_length_q", "max_length_k"))
        return cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k
    positions = call.kwargs.get("position_ids")
    if torch.compiler.is_compiling() or not _positions_fit(positions, batch, seqlen):
        return None  # finding documents in position ids needs the host: eager calls only
    found = _POSITION_DOCS.get(positions, batch, lambda: _documents(positions.expand(batch, -1)))
    return None if found is None else (found[0], found[0], found[1], found[1])


def _positions_fit(positions, batch: int, seqlen: int) -> bool:
    return (
        isinstance(positions, torch.Tensor)
        and positions.ndim == 2
        and positions.shape[1] == seqlen
        and positions.shape[0] in (1, batch)
    )


def _documents(positions: torch.Tensor):
    """(cu_seqlens, longest) of the sequences packed in (B, S) position ids, or None for one per
    row: a sequence starts at every row's start and wherever positions step other than +1."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    first = starts.flatten().nonzero().flatten()
    cu = torch.cat((first, first.new_full((1,), positions.numel()))).to(torch.int32)
    return cu, int(cu.diff().max())


def _host_int(value) -> int | None:
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not torch.compiler.is_compiling():
        return int(value)
    return None  # the kernel for unbounded lengths


def _keys_past_queries(q_length, kv_length, q_offset, kv_offset) -> bool:
    """Whether a layer's keys run past its last query: a static cache's preallocated slots."""
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor):
        return True  # a static cache (it counts tokens on the device) holds max_cache_len keys
    return kv_offset + kv_length > q_offset + q_length


class _TensorMemo:
    """Values computed from a tensor, kept while it is the same unmodified tensor (eager calls):
    every layer of a forward pass gets the same mask and position ids, so each is read (with its
    device sync) once per pass, not once per layer."""

    def __init__(self, size: int = 8):
        self.size = size
        self.items: dict = {}

    def get(self, tensor: torch.Tensor, extra, compute: Callable):
        try:
            version = tensor._version
        except RuntimeError:  # inference-mode tensors have no version counter: keep nothing
            return compute()
        key = (id(tensor), extra)
        hit = self.items.get(key)
        if hit is not None and hit[0]() is tensor and hit[1] == version:
            return hit[2]
        value = compute()
        if len(self.items) >= self.size:
            self.items.pop(next(iter(self.items)))
        self.items[key] = (weakref.ref(tensor), version, value)
        return value


_UNPADDING = _TensorMemo()
_POSITION_DOCS = _TensorMemo()


# ----------------------------------------------------------------------------- fallbacks
_WARNED: set[str] = set()


@torch.compiler.assume_constant_result
def _warn_once(message: str) -> bool:
    """Warn once per message (torch.compile runs this while tracing, never in a graph)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, FallbackWarning, stacklevel=4)
    return True


def _fallback(problem: str, model: _Model | None, layer: LayerKernels | None, call: _Call):
    """transformers' SDPA attention, or the model's eager attention where SDPA would drop what the
    layer needs (softcap, sinks, attention weights)."""
    eager = call.s_aux is not None or call.softcap is not None or bool(call.kwargs.get("output_attentions"))
    implementation = "eager" if eager else "sdpa"
    where = f"{model.model_type} " if model is not None else ""
    where += f"{layer.layer_type} layers" if layer is not None else "attention layers"
    _warn_once(f"fa4gen: {where} run on transformers' {implementation} attention, not fa4gen kernels: {problem}")
    mask = call.attention_mask
    ours = model is not None and model.problem is None  # then None and 2D masks came from fa4gen_mask
    if (mask is None and ours) or (mask is not None and mask.ndim == 2):
        mask = _visible_mask(call)
    query, key, value = call.query, call.key, call.value
    if not eager:
        return sdpa_attention_forward(
            call.module, query, key, value, mask, dropout=call.dropout, scaling=call.scaling, is_causal=call.is_causal,
            **call.kwargs,
        )  # fmt: skip
    modeling = sys.modules.get(type(call.module).__module__)
    function = getattr(modeling, "eager_attention_forward", None) or _eager_attention
    if mask is not None and mask.dtype == torch.bool:  # eager attention adds its mask to the scores
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min
        )
    scaling = call.scaling if call.scaling is not None else query.shape[-1] ** -0.5
    return function(
        call.module, query, key, value, mask, dropout=call.dropout, scaling=scaling, softcap=call.softcap,
        sliding_window=call.sliding_window, s_aux=call.s_aux, **call.kwargs,
    )  # fmt: skip


def _visible_mask(call: _Call) -> torch.Tensor:
    """transformers' boolean mask for the call, (B or 1, 1, Sq, Sk): causal and sliding window
    (q - k < W) on positions aligned to the end of the keys, the 2D padding mask, packed sequences."""
    query, key = call.query, call.key
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    rows = torch.arange(seqlen_q, device=query.device).view(-1, 1) + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=query.device).view(1, -1)
    causal = call.is_causal if call.is_causal is not None else getattr(call.module, "is_causal", True)
    visible = cols <= rows if causal else torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=query.device)
    if call.sliding_window is not None:
        distance = rows - cols if causal else (rows - cols).abs()
        visible = visible & (distance < call.sliding_window)
    visible = visible.view(1, 1, seqlen_q, seqlen_k)
    if call.attention_mask is not None:
        return visible & call.attention_mask.bool()[:, None, None, :]
    segments = _segments(call) if seqlen_q == seqlen_k else None
    if segments is not None:
        visible = visible & (segments[:, None, :, None] == segments[:, None, None, :])
    return visible


def _segments(call: _Call) -> torch.Tensor | None:
    """(B, S) sequence ids of packed sequences (no host sync), or None."""
    batch, seqlen = call.query.shape[0], call.query.shape[2]
    cu = call.kwargs.get("cu_seq_lens_q")
    if cu is not None and call.kwargs.get("cu_seq_lens_k") is not None:
        tokens = torch.arange(batch * seqlen, device=cu.device)
        return (torch.searchsorted(cu.long(), tokens, right=True) - 1).view(batch, seqlen)
    positions = call.kwargs.get("position_ids")
    if not _positions_fit(positions, batch, seqlen):
        return None
    positions = positions.expand(batch, -1)
    return (torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1) != 1).cumsum(-1)


def _eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                     s_aux=None, **kwargs):  # fmt: skip
    """Eager attention with softcap and sinks, for models whose modeling module has none."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    if s_aux is not None:  # the sink takes probability and carries no value
        sinks = s_aux.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat((scores, sinks), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = probs[..., :-1] if s_aux is not None else probs
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs
