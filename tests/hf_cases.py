"""transformers' own attention for the model families fa4gen.hf maps, in one place: the cases
that tests/test_hf.py (CPU, fp32, fa4gen's reference) and tests/test_gpu_hf.py (the H200,
fa4gen's bf16 kernels) compare against, and the specs the GPU cache warm step compiles for them.

For one (family, layer type, cached tokens, new tokens), ``hf_case`` draws q, k, v in the input
dtype, builds transformers' own mask for that layer type (masking_utils over its DynamicCache)
and runs the model's eager attention (its ``eager_attention_forward``, or the attention module
itself for ALiBi and Llama 4's NoPE layers) in float32 on those same values, and, for a
low-precision input dtype, once more in that dtype: PyTorch's own error, whose double bounds a
kernel's (``transformers_error_bound``).

Importable without transformers (``hf_gpu_specs`` and the case lists need only fa4gen.hf); the
functions that run transformers import it when called.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from fa4gen.hf import hf_specs, specs_from_hf_config
from fa4gen.spec import AttentionSpec


def _llama4(**extra):
    return dict(model_type="llama4_text", num_attention_heads=5, num_key_value_heads=1, head_dim=128,
                hidden_size=640, num_hidden_layers=2, no_rope_layer_interval=2, attention_chunk_size=6,
                floor_scale=4, attn_scale=0.5, **extra)  # fmt: skip


# tiny configs: real head dims and GQA ratios, small windows and chunks so shapes cross them
FAMILIES = {
    "llama": dict(model_type="llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=1024,
                  num_hidden_layers=1),
    "mistral": dict(model_type="mistral", num_attention_heads=8, num_key_value_heads=2, hidden_size=1024,
                    sliding_window=5, num_hidden_layers=1),
    "mixtral": dict(model_type="mixtral", num_attention_heads=8, num_key_value_heads=2, hidden_size=1024,
                    sliding_window=6, num_hidden_layers=1),
    "qwen2": dict(model_type="qwen2", num_attention_heads=14, num_key_value_heads=2, hidden_size=1792,
                  use_sliding_window=True, sliding_window=5, max_window_layers=1, num_hidden_layers=2),
    "qwen3": dict(model_type="qwen3", num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                  hidden_size=256, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                  num_hidden_layers=2),
    # Qwen2-MoE slides on even layers below max_window_layers; Qwen3-MoE on every layer
    "qwen2_moe": dict(model_type="qwen2_moe", num_attention_heads=8, num_key_value_heads=2, hidden_size=1024,
                      use_sliding_window=True, sliding_window=5, max_window_layers=2, num_hidden_layers=2),
    "qwen3_moe": dict(model_type="qwen3_moe", num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                      hidden_size=256, use_sliding_window=True, sliding_window=6, num_hidden_layers=1),
    "gemma2": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                   hidden_size=256, query_pre_attn_scalar=144, sliding_window=5, attn_logit_softcapping=2.0,
                   num_hidden_layers=2),
    "gemma3": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                   hidden_size=256, query_pre_attn_scalar=168, sliding_window=5, sliding_window_pattern=2,
                   attn_logit_softcapping=2.0, num_hidden_layers=2),
    "phi3": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=4, hidden_size=384,
                 sliding_window=6, num_hidden_layers=1),
    "gpt_oss": dict(model_type="gpt_oss", num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                    hidden_size=256, sliding_window=4, num_hidden_layers=2),
    "llama4": _llama4(),
    "deepseek_v3": dict(model_type="deepseek_v3", num_attention_heads=4, num_key_value_heads=4, hidden_size=128,
                        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, num_hidden_layers=1,
                        rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "rope_theta": 10000.0}),
    "bloom": dict(model_type="bloom", n_head=6, hidden_size=768, n_layer=1),  # 6: not a power of two
    "mpt": dict(model_type="mpt", n_heads=6, d_model=768, n_layers=1, max_seq_len=32),
}  # fmt: skip

# the GPU test's configs: FAMILIES with windows and chunks that cross key tiles at its shapes
# (257 keys: a window of two 128-key tiles and one key more; GPT-OSS's own 128; chunks of 300) and
# MPT's ALiBi table as long as mpt-7b's (at least every key); the other specs are the CPU ones
GPU_CHANGES = {
    "mistral": {"sliding_window": 257},
    "mixtral": {"sliding_window": 257},  # the same spec as mistral's and qwen3's sliding layers
    "qwen2": {"sliding_window": 257},
    "qwen3": {"sliding_window": 257},
    "qwen2_moe": {"sliding_window": 257},
    "qwen3_moe": {"sliding_window": 257},
    "gemma2": {"sliding_window": 257},
    "gemma3": {"sliding_window": 257},
    "phi3": {"sliding_window": 257},
    "gpt_oss": {"sliding_window": 128},
    "llama4": {"attention_chunk_size": 300},
    "mpt": {"max_seq_len": 2048},
}
GPU_FAMILIES = {family: dict(config, **GPU_CHANGES.get(family, {})) for family, config in FAMILIES.items()}

MODULES = {
    "llama": ("llama", "LlamaAttention"),
    "mistral": ("mistral", "MistralAttention"),
    "mixtral": ("mixtral", "MixtralAttention"),
    "qwen2": ("qwen2", "Qwen2Attention"),
    "qwen3": ("qwen3", "Qwen3Attention"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeAttention"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeAttention"),
    "gemma2": ("gemma2", "Gemma2Attention"),
    "gemma3": ("gemma3", "Gemma3Attention"),
    "phi3": ("phi3", "Phi3Attention"),
    "gpt_oss": ("gpt_oss", "GptOssAttention"),
    "llama4": ("llama4", "Llama4TextAttention"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Attention"),
    "bloom": ("bloom", "BloomAttention"),
    "mpt": ("mpt", "MptAttention"),
}
MASKS = {  # the masking_utils function each layer type's mask comes from in the models' forward
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
}
ALIBI = ("bloom", "mpt")
BATCH = 2
# (cached tokens, new query tokens): prefill, then KV-cache shapes (sliding layers' caches keep the
# last W - 1 keys, so Sk = W - 1 + Sq there once the cache is full)
SHAPES = ((0, 13), (9, 4), (12, 1))
# chunked layers: transformers' cache keeps the last chunk - 1 keys, whose chunk boundaries are
# absolute positions; fa4gen counts chunks from the first key passed, so only caches that start at
# position 0 (fewer cached tokens than the chunk size) are the same thing
CHUNKED_SHAPES = ((0, 13), (4, 5), (5, 1))
# the GPU test's: prefill of 1, 200 and 1000 tokens; decoding and a 17-token step after 900 cached
# (a full 256-key cache on sliding layers), 300 new after 200 (Sq < Sk, both past a tile); chunked
# layers' caches stay under the 300-token chunk, the new tokens crossing its end at 290 + 17
GPU_SHAPES = ((0, 1), (0, 200), (0, 1000), (900, 1), (900, 17), (200, 300))
GPU_CHUNKED_SHAPES = ((0, 1), (0, 200), (0, 1000), (299, 1), (290, 17), (200, 300))


def cases(configs: dict = FAMILIES, shapes=SHAPES, chunked_shapes=CHUNKED_SHAPES) -> list[tuple[str, str, int, int]]:
    """(family, layer type, cached tokens, new tokens) for every layer type of every family."""
    out = []
    for family, config in configs.items():
        for layer_type in specs_from_hf_config(dict(config)):
            for past, new in chunked_shapes if layer_type == "chunked_attention" else shapes:
                out.append((family, layer_type, past, new))
    return out


def case_id(family: str, layer_type: str, past: int, new: int) -> str:
    return f"{family}-{layer_type}-{past}+{new}"


def hf_gpu_specs() -> dict[str, AttentionSpec]:
    """``family/layer_type`` -> the spec tests/test_gpu_hf.py compiles (bf16, from GPU_FAMILIES):
    what the GPU cache warm step must build. Several names share a spec."""
    return {
        f"{family}/{layer_type}": spec
        for family, config in GPU_FAMILIES.items()
        for layer_type, spec in specs_from_hf_config(dict(config)).items()
    }


def _config(family: str, configs: dict = FAMILIES, **extra):
    from transformers import AutoConfig

    data = dict(configs[family], **extra)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    config._attn_implementation = "sdpa"  # boolean masks from masking_utils
    return config


def _module(family: str, config, layer: int):
    package, name = MODULES[family]
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    module = getattr(modeling, name)(config, layer_idx=layer).eval()
    return modeling, module


def _kv_dims(config, family: str) -> tuple[int, int, int]:
    """(kv heads, key dim, value dim) of what the model caches."""
    if family == "deepseek_v3":
        return config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    if family in ALIBI:
        heads = config.num_attention_heads
        return heads, config.hidden_size // heads, config.hidden_size // heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, dim, dim


def _runs_module(family: str, layer_type: str) -> bool:
    """Whether the attention module itself runs (what happens inside it is the variant: ALiBi,
    Llama 4's NoPE query temperature) rather than the model's eager_attention_forward."""
    return family in ALIBI or (family == "llama4" and layer_type == "full_attention")


class _Fixed(torch.nn.Module):
    """A projection that returns a given tensor (the chosen q, k, v in the layout the module
    splits), in the dtype of the module's input."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.value.to(hidden.dtype)


@dataclass
class HFCase:
    """One comparison: q, k, v in fa4gen's (B, S, H, D) layout and the input dtype (k, v: every key
    the layer attended to, cached and new), the spec's run-time arguments (float32), transformers'
    boolean mask (B, 1, Sq, Sk) and its attention output (B, Sq, Hq, Dv) computed in float32 from
    those values (``out``) and in the input dtype (``out_low``; None for float32 inputs)."""

    spec: AttentionSpec
    layers: list[int]  # from-hf's layers of this type
    layer_types: list[str] | None  # transformers' config.layer_types
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    args: dict
    mask: torch.Tensor
    out: torch.Tensor
    out_low: torch.Tensor | None


def hf_case(
    family: str,
    layer_type: str,
    past: int,
    new: int,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    seed: int = 0,
    configs: dict = FAMILIES,
) -> HFCase:
    """Random inputs (normal, rounded to ``dtype``; GPT-OSS sinks too) for BATCH sequences of
    ``past`` cached and ``new`` query tokens of one layer of ``family``, and transformers' output
    on them in float32 and in ``dtype``."""
    item = hf_specs(dict(configs[family]))[layer_type]
    config = _config(family, configs)
    heads_kv, dim_k, dim_v = _kv_dims(config, family)
    heads_q = heads_kv * item.spec.qhead_per_kvhead
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    # transformers' layout, (B, H, S, D)
    inputs = {
        "q": randn(BATCH, heads_q, new, dim_k),
        "k_past": randn(BATCH, heads_kv, past, dim_k),
        "v_past": randn(BATCH, heads_kv, past, dim_v),
        "k_new": randn(BATCH, heads_kv, new, dim_k),
        "v_new": randn(BATCH, heads_kv, new, dim_v),
    }
    args = {"sinks": randn(heads_q).float()} if item.spec.sinks else {}
    run = dict(family=family, layer_type=layer_type, configs=configs, layer=item.layers[0], sinks=args.get("sinks"))
    out, k, v, mask = _transformers_attention(**run, **inputs, dtype=torch.float32)
    out_low = None
    if dtype != torch.float32:
        out_low, k_low, v_low, mask_low = _transformers_attention(**run, **inputs, dtype=dtype)
        assert torch.equal(mask_low, mask) and torch.equal(k_low.float(), k) and torch.equal(v_low.float(), v)
    return HFCase(
        spec=item.spec,
        layers=item.layers,
        layer_types=getattr(config, "layer_types", None),
        q=inputs["q"].transpose(1, 2).contiguous(),
        k=k.to(dtype).transpose(1, 2).contiguous(),
        v=v.to(dtype).transpose(1, 2).contiguous(),
        args=args,
        mask=mask,
        out=out,
        out_low=out_low,
    )


def transformers_error_bound(case: HFCase, *, factor: float = 2.0, floor: float = 1e-5) -> float:
    """``factor`` x transformers' own error in the input dtype (its eager attention run in that
    dtype against the float32 run), plus a floor for outputs near zero: the bound
    fa4gen.testing.error_bound sets with fa4gen's reference, with transformers' computation."""
    assert case.out_low is not None, "a float32 case has no low-precision run"
    return factor * (case.out_low.float() - case.out).abs().max().item() + floor


def assert_matches_transformers(case: HFCase, out: torch.Tensor) -> dict:
    """A kernel's output (B, Sq, Hq, Dv) in the input dtype against transformers' float32 output:
    no NaN, and an error at most ``transformers_error_bound``. Then against fa4gen's float32
    reference with its own bound (fa4gen.testing.assert_close_to_reference), which stays tight
    where transformers' low-precision error is large (BLOOM builds its ALiBi table in the model's
    dtype: bf16 keeps 8 bits of slope x position). Returns the errors and bounds."""
    from fa4gen.testing import assert_close_to_reference

    assert out.shape == case.out.shape, f"output shape {tuple(out.shape)}, transformers' {tuple(case.out.shape)}"
    assert not torch.isnan(out).any(), "output has NaN (poisoned entries were not overwritten?)"
    err = (out.float() - case.out).abs().max().item()
    bound = transformers_error_bound(case)
    report = {"hf_err": err, "hf_bound": bound}
    assert err <= bound, f"error {err:.3e} against transformers exceeds 2x its own {case.q.dtype} error {bound:.3e}"
    report.update(assert_close_to_reference(case.spec, case.q, case.k, case.v, out, args=case.args))
    return report


def _transformers_attention(*, family, layer_type, configs, layer, q, k_past, v_past, k_new, v_new, sinks, dtype):
    """transformers' attention of ``layer`` computed in ``dtype`` (the module and the inputs cast
    to it, as a model in that dtype runs): (out (B, Sq, Hq, Dv), k, v (B, H, Sk, D), boolean mask)."""
    from transformers import DynamicCache, masking_utils

    device = q.device
    config = _config(family, configs)
    batch, _, new, _ = q.shape
    past = k_past.shape[2]
    cache = DynamicCache(config=config)
    if past:  # every layer of the cache, so the mask functions find their layer type's
        for index in range(len(cache.layers)):
            cache.update(k_past.to(dtype), v_past.to(dtype), index)
    hidden = torch.zeros(batch, new, config.hidden_size, device=device, dtype=dtype)
    padding = torch.ones(batch, past + new, dtype=torch.long, device=device) if family in ALIBI else None
    mask = getattr(masking_utils, MASKS[layer_type])(
        config=config, inputs_embeds=hidden, attention_mask=padding, past_key_values=cache, allow_is_causal_skip=False
    )
    # what masking_utils.eager_mask makes (the models' eager mask) in this dtype
    additive = torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)
    config._attn_implementation = "eager"  # the mask is made: modules run transformers' eager attention
    modeling, module = _module(family, config, layer)
    module.to(device=device, dtype=dtype)
    if sinks is not None:
        with torch.no_grad():
            module.sinks.copy_(sinks)
    q, k_new, v_new = q.to(dtype), k_new.to(dtype), v_new.to(dtype)
    if _runs_module(family, layer_type):
        out = _module_forward(family, modeling, module, config, hidden, q, k_new, v_new, mask, additive, cache)
        k, v = cache.layers[layer].keys, cache.layers[layer].values  # everything the layer attended to
    else:
        k, v = cache.update(k_new, v_new, layer)
        extra = {"softcap": module.attn_logit_softcapping} if family == "gemma2" else {}  # Gemma 3 passes none
        with torch.no_grad():
            out, _ = modeling.eager_attention_forward(
                module, q, k, v, additive, dropout=0.0, scaling=module.scaling, **extra
            )
    return out.float(), k.float(), v.float(), mask


def _module_forward(family, modeling, module, config, hidden, q, k_new, v_new, mask, additive, cache):
    """Run the attention module itself, its projections returning the chosen q, k, v (B, H, S, D)
    and its out projection made the identity, for what happens inside it: ALiBi (BLOOM, MPT) and
    Llama 4's NoPE query temperature. Returns the attention output (B, Sq, Hq, Dv)."""
    batch, heads, new, _ = q.shape

    def merged(x):  # (B, H, S, D) -> (B, S, H * D)
        return x.transpose(1, 2).reshape(batch, new, -1)

    with torch.no_grad():
        if family == "bloom":
            module.dense.weight.copy_(torch.eye(config.hidden_size))
            module.dense.bias.zero_()
            # BloomAttention._reshape: (B, S, H * 3 * D) viewed as (B, S, H, 3, D)
            fused = torch.stack([x.transpose(1, 2) for x in (q, k_new, v_new)], dim=3).reshape(batch, new, -1)
            module.query_key_value = _Fixed(fused)
            # BloomModel builds ALiBi in the model's dtype
            padding = torch.ones(batch, cache.get_seq_length() + new, dtype=torch.long, device=hidden.device)
            alibi = modeling.build_alibi_tensor(padding, heads, hidden.dtype)
            out = module(hidden, torch.zeros_like(hidden), alibi, additive, layer_past=cache, use_cache=True)[0]
        elif family == "mpt":
            module.out_proj.weight.copy_(torch.eye(config.hidden_size))
            module.Wqkv = _Fixed(torch.cat([merged(q), merged(k_new), merged(v_new)], dim=2))  # chunked in 3
            # MptModel builds ALiBi in float32 and passes its eager mask as booleans: True where masked
            alibi = modeling.build_mpt_alibi_tensor(heads, config.max_seq_len, device=hidden.device)
            out = module(hidden, alibi, past_key_values=cache, attention_mask=~mask)[0]
        else:  # llama4 NoPE layer: no rotary embedding, no qk norm
            assert not module.use_rope and not hasattr(module, "qk_norm")
            module.o_proj.weight.copy_(torch.eye(config.hidden_size))
            module.q_proj, module.k_proj, module.v_proj = (_Fixed(merged(x)) for x in (q, k_new, v_new))
            out = module(hidden, None, additive, past_key_values=cache)[0]
    return out.view(batch, new, heads, -1)
