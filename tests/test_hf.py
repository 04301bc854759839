"""fa4gen.hf (`fa4gen from-hf`) against transformers itself, on the CPU.

- Real models' config.json files (tests/hf_configs/, trimmed by hand to the fields that matter)
  give the expected specs, and the model-named spec files in specs/ are what from-hf gives.
- For each family, a tiny config with the real head dims and GQA ratio: transformers' own masks
  (masking_utils' create_*_mask over its DynamicCache) equal fa4gen.testing.visible_keys for the
  spec from-hf produced, and the model's eager attention (its eager_attention_forward, or the
  attention module itself for ALiBi and Llama 4's NoPE layers) agrees in fp32 with
  fa4gen.testing.reference, on prefill (Sq == Sk) and KV-cache (Sq < Sk) shapes (the cases and
  transformers' side of them: tests/hf_cases.py).
- tests/test_gpu_hf.py's harness, with fa4gen's reference in the kernel's place: every GPU case
  (bf16 inputs, larger windows, chunks and shapes) builds, its masks are fa4gen's, an exact
  kernel meets its bounds, and kernels that get a part of the variant wrong do not.
- from-hf's errors, and the command line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_cases import (
    BATCH,
    GPU_CHUNKED_SHAPES,
    GPU_FAMILIES,
    GPU_SHAPES,
    assert_matches_transformers,
    case_id,
    cases,
    hf_case,
    hf_gpu_specs,
)

from fa4gen.hf import HFConfigError, hf_specs, specs_from_hf_config, write_hf_specs
from fa4gen.spec import AttentionSpec
from fa4gen.specfile import load_spec
from fa4gen.testing import reference, visible_keys
from fa4gen.variants import standard_alibi_slopes

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig  # noqa: E402

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
    "qwen3-30b-a3b": {"full_attention": _spec(head_dim=128, qhead_per_kvhead=8, causal=True)},
    "qwen1.5-moe-a2.7b": {"full_attention": _spec(head_dim=128, qhead_per_kvhead=1, causal=True)},
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
    for model_type in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma2",
                       "gemma3_text", "gemma3", "phi3",
                       "gpt_oss", "llama4_text", "llama4", "deepseek_v3", "bloom", "mpt"):  # fmt: skip
        ours = specs_from_hf_config({"model_type": model_type})
        assert ours == specs_from_hf_config(AutoConfig.for_model(model_type).to_dict()), model_type


# ----------------------------------------------------------------------------- against transformers
@pytest.mark.parametrize("family, layer_type, past, new", [pytest.param(*c, id=case_id(*c)) for c in cases()])
def test_against_transformers(family, layer_type, past, new):
    case = hf_case(family, layer_type, past, new)
    if case.layer_types is not None:  # from-hf put the same layers under this type as transformers does
        assert case.layers == [i for i, t in enumerate(case.layer_types) if t == layer_type]
    seqlen_k = case.k.shape[1]
    assert seqlen_k == case.mask.shape[-1]
    ours = visible_keys(case.spec, new, seqlen_k).expand(BATCH, 1, new, seqlen_k)
    mask = case.mask
    assert torch.equal(mask, ours), f"masks differ:\ntransformers\n{mask[0, 0].int()}\nfa4gen\n{ours[0, 0].int()}"
    expected, _ = reference(case.spec, case.q, case.k, case.v, args=case.args)
    assert case.out.shape == expected.shape
    torch.testing.assert_close(case.out, expected, rtol=1e-5, atol=1e-5)


GPU_CASES = cases(GPU_FAMILIES, GPU_SHAPES, GPU_CHUNKED_SHAPES)


def _stand_in(spec, case, **changes):
    """What a kernel for ``spec`` (with ``changes``) writes, were it exact to rounding: fa4gen's
    float32 reference rounded to the input dtype."""
    if changes:
        spec = AttentionSpec(**{**spec.model_dump(), **changes})
    args = case.args if spec.sinks else {}
    return reference(spec, case.q, case.k, case.v, args=args)[0].to(case.q.dtype)


@pytest.mark.parametrize("family, layer_type, past, new", [pytest.param(*c, id=case_id(*c)) for c in GPU_CASES])
def test_gpu_harness_on_cpu(family, layer_type, past, new):
    """tests/test_gpu_hf.py's cases on the CPU, fa4gen's reference (rounded to bf16) in the
    kernel's place: each case's spec is the one hf_gpu_specs() names for the warm step,
    transformers' masks at the GPU configs and shapes are fa4gen's, and the output meets both
    bounds."""
    case = hf_case(family, layer_type, past, new, dtype=torch.bfloat16, configs=GPU_FAMILIES, seed=len(GPU_CASES))
    assert case.spec == hf_gpu_specs()[f"{family}/{layer_type}"] and case.spec.dtype == "bfloat16"
    assert case.q.dtype == case.k.dtype == case.v.dtype == torch.bfloat16 and case.out.dtype == torch.float32
    seqlen_k = case.k.shape[1]
    assert torch.equal(case.mask, visible_keys(case.spec, new, seqlen_k).expand(BATCH, 1, new, seqlen_k))
    assert_matches_transformers(case, _stand_in(case.spec, case))
    # transformers' float32 result is fa4gen's float32 reference, to float32 rounding (summed over
    # up to 1000 keys, in other orders: up to 1e-5 of the output's scale at BLOOM's and MPT's ALiBi)
    ref, _ = reference(case.spec, case.q, case.k, case.v, args=case.args)
    assert (ref.float() - case.out).abs().max() <= 1e-4 * case.out.abs().max()


# a kernel that gets one part of the variant wrong: the GPU test's bounds catch it
SLIPS = {
    "mistral-sliding_attention-0+1000": {"window_left": 257},  # one key more
    "qwen2-sliding_attention-900+17": {"window_left": 255},  # one key fewer
    "gemma2-full_attention-200+300": {"softcap": None},
    "gemma3-full_attention-0+1000": {"softmax_scale": None},  # head_dim**-0.5, not query_pre_attn_scalar's
    "gpt_oss-sliding_attention-0+200": {"sinks": False},
    "llama4-chunked_attention-290+17": {"mask": {"kind": "chunked", "size": 301}},
    "llama4-full_attention-900+17": {"score_mod": None},  # no NoPE temperature
    "deepseek_v3-full_attention-200+300": {"softmax_scale": 192**-0.5},  # no YaRN mscale
    "bloom-full_attention-0+1000": {"score_mod": None},  # within 2x transformers' own bf16 error
    "mpt-full_attention-900+1": {"score_mod": None},
    "llama-full_attention-0+200": {"causal": False},
}


@pytest.mark.parametrize("name", sorted(SLIPS))
def test_gpu_harness_catches_slips(name):
    """Each slip misses 2x transformers' own bf16 error, but BLOOM's: its bf16 ALiBi table makes
    that error as large as the outputs at 1000 positions, and fa4gen's bound catches it."""
    family, layer_type, past, new = next(c for c in GPU_CASES if case_id(*c) == name)
    case = hf_case(family, layer_type, past, new, dtype=torch.bfloat16, configs=GPU_FAMILIES, seed=3)
    problem = "2x PyTorch's own error bound" if family == "bloom" else "against transformers exceeds"
    with pytest.raises(AssertionError, match=problem):
        assert_matches_transformers(case, _stand_in(case.spec, case, **SLIPS[name]))


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
