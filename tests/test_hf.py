"""fa4gen.hf (`fa4gen from-hf`) against transformers itself, on the CPU.

- Real models' config.json files (tests/hf_configs/, trimmed by hand to the fields that matter)
  give the expected specs, and the model-named spec files in specs/ are what from-hf gives.
- For each family, a tiny config with the real head dims and GQA ratio: transformers' own masks
  (masking_utils' create_*_mask over its DynamicCache) equal fa4gen.testing.visible_keys for the
  spec from-hf produced, and the model's eager attention (its eager_attention_forward, or the
  attention module itself for ALiBi and Llama 4's NoPE layers) agrees in fp32 with
  fa4gen.testing.reference, on prefill (Sq == Sk) and KV-cache (Sq < Sk) shapes.
- from-hf's errors, and the command line.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

from fa4gen.hf import HFConfigError, hf_specs, specs_from_hf_config, write_hf_specs
from fa4gen.spec import AttentionSpec
from fa4gen.specfile import load_spec
from fa4gen.testing import reference, visible_keys
from fa4gen.variants import standard_alibi_slopes

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, DynamicCache, masking_utils  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "hf_configs"
SPECS = HERE.parent / "specs"
DEEPSEEK_V3_SCALE = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2


def _spec(**fields) -> AttentionSpec:
    return AttentionSpec(**fields)


# ----------------------------------------------------------------------------- real configs
GQA4 = dict(head_dim=128, qhead_per_kvhead=4, causal=True)
EXPECTED = {
    "llama3-8b": {"full_attention": _spec(**GQA4)},
    "mistral-7b-v0.1": {"sliding_attention": _spec(**GQA4, window_left=4095)},
    "mistral-7b-v0.3": {"full_attention": _spec(**GQA4)},
    "mixtral-8x7b": {"full_attention": _spec(**GQA4)},
    "qwen2-7b": {"full_attention": _spec(head_dim=128, qhead_per_kvhead=7, causal=True)},
    "qwen2.5-72b": {"full_attention": _spec(head_dim=128, qhead_per_kvhead=8, causal=True)},
    "qwen3-8b": {"full_attention": _spec(**GQA4)},
    "gemma2-9b": {
        "sliding_attention": _spec(head_dim=256, qhead_per_kvhead=2, causal=True, window_left=4095, softcap=50.0),
        "full_attention": _spec(head_dim=256, qhead_per_kvhead=2, causal=True, softcap=50.0),
    },
    "gemma2-27b": {
        "sliding_attention": _spec(
            head_dim=128, qhead_per_kvhead=2, causal=True, window_left=4095, softcap=50.0, softmax_scale=1 / 12
        ),
        "full_attention": _spec(head_dim=128, qhead_per_kvhead=2, causal=True, softcap=50.0, softmax_scale=1 / 12),
    },
    "gemma3-1b": {
        "sliding_attention": _spec(head_dim=256, qhead_per_kvhead=4, causal=True, window_left=511),
        "full_attention": _spec(head_dim=256, qhead_per_kvhead=4, causal=True),
    },
    "gemma3-27b": {
        "sliding_attention": _spec(
            head_dim=128, qhead_per_kvhead=2, causal=True, window_left=1023, softmax_scale=168**-0.5
        ),
        "full_attention": _spec(head_dim=128, qhead_per_kvhead=2, causal=True, softmax_scale=168**-0.5),
    },
    "phi3-mini-4k": {"sliding_attention": _spec(head_dim=96, causal=True, window_left=2046)},
    "phi3-mini-128k": {"sliding_attention": _spec(head_dim=96, causal=True)},  # 262144 >= every position
    "gpt-oss-20b": {
        "sliding_attention": _spec(head_dim=64, qhead_per_kvhead=8, causal=True, window_left=127, sinks=True),
        "full_attention": _spec(head_dim=64, qhead_per_kvhead=8, causal=True, sinks=True),
    },
    "llama4-scout": {
        "chunked_attention": _spec(head_dim=128, qhead_per_kvhead=5, mask={"kind": "chunked", "size": 8192}),
        "full_attention": _spec(
            head_dim=128,
            qhead_per_kvhead=5,
            causal=True,
            score_mod={
                "kind": "expression",
                "expr": "score * (log(1.0 + (q_idx + (seqlen_k - seqlen_q) + 1) // 8192) * 0.1 + 1.0)",
            },
        ),
    },
    "deepseek-v3": {
        "full_attention": _spec(head_dim=192, head_dim_v=128, causal=True, softmax_scale=DEEPSEEK_V3_SCALE)
    },
    "bloom-7b1": {"full_attention": _spec(dtype="float16", head_dim=128, causal=True, score_mod="alibi")},
    "mpt-7b": {"full_attention": _spec(head_dim=128, causal=True, score_mod="alibi")},
}

# spec file -> (config, layer type, fields that are the spec file's own choice)
SHIPPED = {
    "llama3-8b": ("llama3-8b", "full_attention", {}),
    "mistral-7b": ("mistral-7b-v0.1", "sliding_attention", {}),
    "gemma2-local": ("gemma2-9b", "sliding_attention", {}),
    "gpt-oss-sinks": ("gpt-oss-20b", "sliding_attention", {}),
    "llama4-chunked": ("llama4-scout", "chunked_attention", {}),
    "deepseek-style": ("deepseek-v3", "full_attention", {"return_lse": True}),
    "alibi-mpt": ("mpt-7b", "full_attention", {}),
    "phi3-mini": ("phi3-mini-128k", "sliding_attention", {}),
    "qwen-fp16": ("qwen2.5-72b", "full_attention", {"dtype": "float16"}),
}


def test_every_config_has_expectations():
    assert {path.stem for path in CONFIGS.glob("*.json")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_config(name):
    specs = specs_from_hf_config(CONFIGS / f"{name}.json")
    assert specs == EXPECTED[name]
    # the same specs from the config transformers itself loads (its defaults filled in, v5 names:
    # dtype, rope_parameters, layer_types)
    data = json.loads((CONFIGS / f"{name}.json").read_text())
    loaded = AutoConfig.for_model(data.pop("model_type"), **data).to_dict()
    assert specs_from_hf_config(loaded) == specs


@pytest.mark.parametrize("stem", sorted(SHIPPED))
def test_shipped_spec_is_what_from_hf_gives(stem):
    config, layer_type, own = SHIPPED[stem]
    expected = specs_from_hf_config(CONFIGS / f"{config}.json")[layer_type].model_copy(update=own)
    assert load_spec(SPECS / f"{stem}.yaml") == AttentionSpec(**expected.model_dump())


def test_provenance_comments():
    text = hf_specs(CONFIGS / "gpt-oss-20b.json")["sliding_attention"].yaml()
    assert "# window_left: 127 = sliding_window - 1 (transformers masks q - k < sliding_window = 128)" in text
    assert "# qhead_per_kvhead: 8 = num_attention_heads / num_key_value_heads (64 / 8)" in text
    assert "layers 0, 2, 4" in text and "(12 of 24)" in text
    text = hf_specs(CONFIGS / "gemma2-9b.json")["full_attention"].yaml()
    assert "dtype: bfloat16 (torch_dtype is float32" in text
    text = hf_specs(CONFIGS / "deepseek-v3.json")["full_attention"].yaml().replace("\n#   ", " ")  # unwrapped
    assert "mscale = 0.1 * rope_scaling.mscale_all_dim * ln(rope_scaling.factor) + 1" in text


def test_every_model_type_with_transformers_defaults():
    """A config that gives only model_type maps as transformers' own defaults do."""
    for model_type in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3",
                       "gpt_oss", "llama4_text", "llama4", "deepseek_v3", "bloom", "mpt"):  # fmt: skip
        ours = specs_from_hf_config({"model_type": model_type})
        assert ours == specs_from_hf_config(AutoConfig.for_model(model_type).to_dict()), model_type


# ----------------------------------------------------------------------------- against transformers
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
MODULES = {
    "llama": ("llama", "LlamaAttention"),
    "mistral": ("mistral", "MistralAttention"),
    "mixtral": ("mixtral", "MixtralAttention"),
    "qwen2": ("qwen2", "Qwen2Attention"),
    "qwen3": ("qwen3", "Qwen3Attention"),
    "gemma2": ("gemma2", "Gemma2Attention"),
    "gemma3": ("gemma3", "Gemma3Attention"),
    "phi3": ("phi3", "Phi3Attention"),
    "gpt_oss": ("gpt_oss", "GptOssAttention"),
    "llama4": ("llama4", "Llama4TextAttention"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Attention"),
    "bloom": ("bloom", "BloomAttention"),
    "mpt": ("mpt", "MptAttention"),
}
MASKS = {  # the mask each layer type gets in the models' forward
    "full_attention": masking_utils.create_causal_mask,
    "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    "chunked_attention": masking_utils.create_chunked_causal_mask,
}
BATCH = 2
# (cached tokens, new query tokens): prefill, then KV-cache shapes (sliding layers' caches keep the
# last W - 1 keys, so Sk = W - 1 + Sq there once the cache is full)
SHAPES = ((0, 13), (9, 4), (12, 1))
# chunked layers: transformers' cache keeps the last chunk - 1 keys, whose chunk boundaries are
# absolute positions; fa4gen counts chunks from the first key passed, so only caches that start at
# position 0 (fewer cached tokens than the chunk size) are the same thing
CHUNKED_SHAPES = ((0, 13), (4, 5), (5, 1))


def _config(family: str, **extra):
    data = dict(FAMILIES[family], **extra)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    config._attn_implementation = "sdpa"  # boolean masks from masking_utils
    return config


def _module(family: str, config, layer: int):
    package, name = MODULES[family]
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    module = getattr(modeling, name)(config, layer_idx=layer).eval()
    return modeling, module


def _cases():
    for family in FAMILIES:
        for layer_type in specs_from_hf_config(dict(FAMILIES[family])):
            shapes = CHUNKED_SHAPES if layer_type == "chunked_attention" else SHAPES
            for past, new in shapes:
                yield pytest.param(family, layer_type, past, new, id=f"{family}-{layer_type}-{past}+{new}")


def _kv_dims(config, family):
    """(kv heads, key dim, value dim) of what the model caches."""
    if family == "deepseek_v3":
        return config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    if family in ("bloom", "mpt"):
        heads = config.num_attention_heads
        return heads, config.hidden_size // heads, config.hidden_size // heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, dim, dim


@pytest.mark.parametrize("family, layer_type, past, new", list(_cases()))
def test_against_transformers(family, layer_type, past, new):
    torch.manual_seed(0)
    config = _config(family)
    item = hf_specs(dict(FAMILIES[family]))[layer_type]
    spec = item.spec
    types = getattr(config, "layer_types", None)
    layer = item.layers[0]
    if types is not None:  # from-hf put the same layers under this type as transformers does
        assert item.layers == [i for i, t in enumerate(types) if t == layer_type]
    heads_kv, dim_k, dim_v = _kv_dims(config, family)
    heads_q = heads_kv * spec.qhead_per_kvhead

    cache = DynamicCache(config=config)
    if past:
        for index in range(len(cache.layers)):
            cache.update(torch.randn(BATCH, heads_kv, past, dim_k), torch.randn(BATCH, heads_kv, past, dim_v), index)
    hidden = torch.randn(BATCH, new, config.hidden_size)
    padding = torch.ones(BATCH, past + new, dtype=torch.long) if family in ("bloom", "mpt") else None
    mask = MASKS[layer_type](
        config=config, inputs_embeds=hidden, attention_mask=padding, past_key_values=cache, allow_is_causal_skip=False
    )
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)  # what masking_utils.eager_mask makes
    modeling, module = _module(family, config, layer)

    if family in ("bloom", "mpt") or (family == "llama4" and layer_type == "full_attention"):
        q, k, v, out = _module_forward(family, modeling, module, config, hidden, mask, additive, cache, padding)
        args = {}
    else:
        q = torch.randn(BATCH, heads_q, new, dim_k)
        k, v = cache.update(torch.randn(BATCH, heads_kv, new, dim_k), torch.randn(BATCH, heads_kv, new, dim_v), layer)
        extra = {}
        if family == "gemma2":
            extra["softcap"] = module.attn_logit_softcapping  # Gemma 3's forward passes none
        args = {}
        if family == "gpt_oss":
            torch.nn.init.normal_(module.sinks)
            args["sinks"] = module.sinks.detach()
        with torch.no_grad():
            out, _ = modeling.eager_attention_forward(
                module, q, k, v, additive, dropout=0.0, scaling=module.scaling, **extra
            )
        q = q.transpose(1, 2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)

    seqlen_k = k.shape[1]
    assert seqlen_k == mask.shape[-1]
    ours = visible_keys(spec, new, seqlen_k).expand(BATCH, 1, new, seqlen_k)
    assert torch.equal(mask, ours), f"masks differ:\ntransformers\n{mask[0, 0].int()}\nfa4gen\n{ours[0, 0].int()}"
    expected, _ = reference(spec, q, k, v, args=args)
    assert out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, rtol=1e-5, atol=1e-5)


def _module_forward(family, modeling, module, config, hidden, mask, additive, cache, padding):
    """Run the attention module itself (its out projection made the identity), for what happens
    inside it: ALiBi (BLOOM, MPT) and Llama 4's NoPE query temperature. Returns q, k, v in
    fa4gen's (B, S, H, D) layout (q before any temperature) and the attention output."""
    heads = module.num_heads if family == "bloom" else getattr(module, "n_heads", None) or config.num_attention_heads
    batch, new, _ = hidden.shape
    with torch.no_grad():
        if family == "bloom":
            module.dense.weight.copy_(torch.eye(config.hidden_size))
            module.dense.bias.zero_()
            q, k_new, v_new = module._reshape(module.query_key_value(hidden))
            alibi = modeling.build_alibi_tensor(padding, heads, torch.float32)
            out = module(hidden, torch.zeros_like(hidden), alibi, additive, layer_past=cache, use_cache=True)[0]
        elif family == "mpt":
            module.out_proj.weight.copy_(torch.eye(config.hidden_size))
            q, k_new, v_new = (
                t.reshape(batch, new, heads, -1).transpose(1, 2) for t in module.Wqkv(hidden).chunk(3, dim=2)
            )
            alibi = modeling.build_mpt_alibi_tensor(heads, config.max_seq_len)
            # MptModel passes its eager mask as booleans: True where a key is masked
            out = module(hidden, alibi, past_key_values=cache, attention_mask=additive.to(torch.bool))[0]
        else:  # llama4 NoPE layer: no rotary embedding, no qk norm
            assert not module.use_rope and not hasattr(module, "qk_norm")
            module.o_proj.weight.copy_(torch.eye(config.hidden_size))
            q = module.q_proj(hidden).view(batch, new, heads, -1).transpose(1, 2)
            out = module(hidden, None, additive, past_key_values=cache)[0]
        layer = cache.layers[module.layer_idx]
        k, v = layer.keys, layer.values  # everything the layer attended to (past + new)
    out = out.view(batch, new, heads, -1)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out


def test_alibi_slopes_match_bloom_and_mpt():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for heads in (*range(1, 65), 80, 96, 112, 128):
        ours = torch.tensor(standard_alibi_slopes(heads))
        bloom = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32).view(heads, 2)[:, 1]
        mpt = -build_mpt_alibi_tensor(heads, 2)[:, 0, 0]
        torch.testing.assert_close(bloom, ours, rtol=1e-6, atol=0)
        torch.testing.assert_close(mpt, ours, rtol=1e-6, atol=0)


def test_t5_buckets_saturate_by_max_distance():
    """specs/t5-relative-bias.yaml: T5's bidirectional buckets (32, max_distance 128) are constant
    past |k - q| = 128, so a table over the clipped distance is exact."""
    from transformers.models.t5.modeling_t5 import T5Attention

    distance = torch.arange(-1000, 1001)
    buckets = T5Attention._relative_position_bucket(distance, bidirectional=True, num_buckets=32, max_distance=128)
    clipped = T5Attention._relative_position_bucket(
        distance.clamp(-128, 128), bidirectional=True, num_buckets=32, max_distance=128
    )
    assert torch.equal(buckets, clipped)


# ----------------------------------------------------------------------------- errors
ERRORS = [
    ({"model_type": "falcon"}, "model_type", "'falcon' is not supported"),
    ({"hidden_size": 64}, "model_type", "missing"),
    ({"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 5}, "num_key_value_heads", "divide"),
    ({"model_type": "llama", "head_dim": 300}, "head_dim", "head_dim=300 is not supported"),
    ({"model_type": "llama", "hidden_size": 3200, "num_attention_heads": 32}, "hidden_size", "head_dim=100"),
    ({"model_type": "deepseek_v3", "v_head_dim": 512}, "v_head_dim", "head_dim_v=512"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window", "at least 1"),
    ({"model_type": "mistral", "sliding_window": "4k"}, "sliding_window", "expected an integer"),
    ({"model_type": "mistral", "is_causal": False}, "is_causal", "bidirectional"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention", "causal"),
    ({"model_type": "gemma2", "sliding_window": None}, "sliding_window", "not set"),
    ({"model_type": "llama4", "text_config": {"attention_chunk_size": None}}, "text_config.attention_chunk_size",
     "not set"),
    ({"model_type": "qwen2", "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]},
     "use_sliding_window", "false"),
    ({"model_type": "qwen3", "num_hidden_layers": 1, "layer_types": ["linear_attention"]}, "layer_types",
     "'linear_attention' is not supported"),
    ({"model_type": "llama", "torch_dtype": "int8"}, "torch_dtype", "'int8' is not supported"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": 0}, "query_pre_attn_scalar", "> 0"),
    ({"model_type": "gemma3", "text_config": [1]}, "text_config", "expected an object"),
    ({"model_type": "gemma2", "attn_logit_softcapping": 1e-39}, "attn_logit_softcapping", "float32 range"),
    ({"model_type": "llama4", "text_config": {"attention_chunk_size": 2**31}}, "text_config.attention_chunk_size",
     "less than or equal"),
]  # fmt: skip


@pytest.mark.parametrize("config, field, problem", ERRORS, ids=[e[1] + "-" + e[2][:12] for e in ERRORS])
def test_errors_name_the_field(config, field, problem):
    with pytest.raises(HFConfigError) as info:
        specs_from_hf_config(config)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"config: {field}: "), message
    assert problem in message, message
    assert isinstance(info.value, ValueError)


def test_file_errors(tmp_path):
    for text, problem in (("{", "not JSON"), ("[1, 2]", "JSON object"), ('{"model_type": 3}', "model_type")):
        path = tmp_path / "config.json"
        path.write_text(text)
        with pytest.raises(HFConfigError, match=problem) as info:
            specs_from_hf_config(path)
        assert str(info.value).startswith(str(path))
    with pytest.raises(HFConfigError, match="No such file"):
        specs_from_hf_config(tmp_path / "missing.json")


def test_windows_past_every_position_are_dropped():
    config = {"model_type": "mistral", "sliding_window": 8192, "max_position_embeddings": 8192}
    assert specs_from_hf_config(config)["sliding_attention"].window_left is None
    config["max_position_embeddings"] = 8193
    assert specs_from_hf_config(config)["sliding_attention"].window_left == 8191


# ----------------------------------------------------------------------------- files and the CLI
def test_write_hf_specs(tmp_path):
    paths = write_hf_specs(CONFIGS / "gemma3-27b.json", tmp_path / "out")
    assert [p.name for p in paths] == ["gemma3-sliding-attention.yaml", "gemma3-full-attention.yaml"]
    specs = specs_from_hf_config(CONFIGS / "gemma3-27b.json")
    assert [load_spec(p) for p in paths] == list(specs.values())
    assert paths[0].read_text().startswith("# Gemma3ForConditionalGeneration (gemma3): sliding_attention, layers 0")


def test_cli_from_hf(tmp_path):
    from typer.testing import CliRunner

    from fa4gen.cli import app

    runner = CliRunner()
    for name in sorted(EXPECTED):
        out = tmp_path / name
        result = runner.invoke(app, ["from-hf", str(CONFIGS / f"{name}.json"), "--out", str(out)])
        assert result.exit_code == 0, result.output
        loaded = {path.name: load_spec(path) for path in out.glob("*.yaml")}
        assert sorted(loaded.values(), key=str) == sorted(EXPECTED[name].values(), key=str), name
        assert len(result.output.strip().splitlines()) == len(loaded)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama", "num_key_value_heads": 7}')
    result = runner.invoke(app, ["from-hf", str(bad), "--out", str(tmp_path / "none")])
    assert result.exit_code == 1
    assert result.output.strip() == f"error: {bad}: num_key_value_heads: 7 does not divide num_attention_heads=32"
    assert not (tmp_path / "none").exists()
