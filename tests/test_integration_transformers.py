"""fa4gen.integrations.transformers: attn_implementation="fa4gen" in transformers models.

CPU: the registered functions dispatch whole models, with fa4gen.ops' kernel replaced by
fa4gen.testing.reference (float32, on the CPU), so the glue (layouts, GQA, scaling, windows,
softcap, sinks, padding, packed sequences, KV caches) is checked end to end against the models'
own SDPA / eager attention; the fallbacks against what they fall back to; torch.compile
(fullgraph, dynamic shapes) traces the kernel path. GPU (marker `gpu`): the example's models in
bf16 on the real kernels, and compiled.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from pathlib import Path

import pytest
import torch

import fa4gen.ops
from fa4gen.testing import reference

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from fa4gen.integrations import transformers as integration  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "transformers_model.py"
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2)
# tiny configs with each family's features: windows of 4-5 keys so 11-token prompts and their
# generations cross them (sliding layers' caches then keep W - 1 keys)
FAMILIES = {
    "llama": (dict(model_type="llama", num_attention_heads=4, num_key_value_heads=1, head_dim=32), "sdpa"),
    "mistral": (
        dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=5),
        "sdpa",
    ),
    "qwen3": (
        dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "sdpa",
    ),
    "gemma2": (  # softcap and query_pre_attn_scalar: transformers' SDPA path drops the softcap
        dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=2.0),
        "eager",
    ),
    "gpt_oss": (  # sinks: GPT-OSS has no SDPA path
        dict(model_type="gpt_oss", num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=4,
             num_local_experts=4, num_experts_per_tok=2),
        "eager",
    ),
}  # fmt: skip
EXPECTED_SPECS = {  # the kernels each family's layers must reach (dense and packed)
    "llama": {"float32 d32 gqa4 causal"},
    "mistral": {"float32 d32 gqa2 causal window(4,0)"},
    "qwen3": {"float32 d32 gqa2 causal", "float32 d32 gqa2 causal window(3,0)"},
    "gemma2": {"float32 d32 gqa2 causal softcap2", "float32 d32 gqa2 causal window(3,0) softcap2"},
    "gpt_oss": {"float32 d32 gqa4 causal sinks", "float32 d32 gqa4 causal window(3,0) sinks"},
}
ATOL = 2e-5  # float32 logits of O(1) through two layers: kernel path vs the model's own attention


# ----------------------------------------------------------------------------- helpers
class ReferenceKernels:
    """fa4gen.ops._kernel on the CPU: fa4gen.testing.reference of the spec, each call recorded."""

    def __init__(self):
        self.calls: list[str] = []  # each call's spec summary, " document" moved to the end

    def __call__(self, spec):
        def run(q, k, v, **variant):
            summary = spec.summary().replace("bfloat16", "float32").replace(" document", "")
            self.calls.append(summary + (" document" if spec.is_varlen else ""))
            args = {name: value for name, value in variant.items() if not name.startswith("max_seqlen")}
            out, _ = reference(spec, q, k, v, args=args)
            return out.to(q.dtype)

        return run


@pytest.fixture
def kernels(monkeypatch):
    """The kernel path on the CPU in float32 (the spec says bfloat16; the reference computes in
    float32 either way); any fallback fails the test."""
    recorder = ReferenceKernels()
    monkeypatch.setattr(fa4gen.ops, "_kernel", recorder)
    monkeypatch.setattr(integration, "_KERNEL_DTYPES", {torch.float32: "bfloat16"})
    monkeypatch.setattr(integration, "_KERNEL_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(integration, "_WARNED", set())
    integration.register()
    with warnings.catch_warnings():
        warnings.simplefilter("error", integration.FallbackWarning)
        yield recorder


@pytest.fixture
def fallbacks(monkeypatch):
    """The real checks (CPU float32 tensors fall back), warnings counted afresh."""
    monkeypatch.setattr(fa4gen.ops, "_kernel", ReferenceKernels())
    monkeypatch.setattr(integration, "_WARNED", set())
    integration.register()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _pair(config: dict, implementation: str, seed: int = 0):
    """(fa4gen model, reference model) with the same random weights, float32 on the CPU."""
    models = []
    for name in ("fa4gen", implementation):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation=name)
        models.append(model.eval())
    with torch.no_grad():  # larger than the default init, so attention patterns matter to the logits
        for parameter in models[0].parameters():
            parameter.normal_(0.0, 0.5 if parameter.ndim == 1 else 0.15)
    models[1].load_state_dict(models[0].state_dict())
    return models


def _family(name: str):
    config, implementation = FAMILIES[name]
    return _pair({**TINY, **config}, implementation)


def _ids(batch: int = 2, seqlen: int = 11, seed: int = 1):
    return torch.randint(0, TINY["vocab_size"], (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def _close(ours, theirs, where=None):
    if where is not None:
        ours, theirs = ours[where], theirs[where]
    assert theirs.abs().max() > 0.1  # the comparison has something to compare
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)


# ----------------------------------------------------------------------------- registering
def test_register_is_idempotent():
    assert integration.register() == "fa4gen"
    assert integration.register() == "fa4gen"
    assert AttentionInterface._global_mapping["fa4gen"] is integration.fa4gen_attention
    assert AttentionMaskInterface._global_mapping["fa4gen"] is integration.fa4gen_mask
    assert transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS.valid_keys().count("fa4gen") == 1


def test_from_config_and_set_attn_implementation_accept_the_name():
    integration.register()
    config = AutoConfig.for_model(**TINY, model_type="llama", num_attention_heads=4, head_dim=16)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fa4gen")
    assert model.config._attn_implementation == "fa4gen"
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("fa4gen")
    assert model.model.layers[0].self_attn.config._attn_implementation == "fa4gen"


def test_kernel_specs_cover_every_layer_type():
    config = AutoConfig.for_model(**TINY, **FAMILIES["gpt_oss"][0])
    specs = integration.kernel_specs(config, dtypes=("bfloat16", "float16"))
    assert len(specs) == 8
    sliding = specs["sliding_attention/float16/packed"]
    assert (sliding.dtype, sliding.window_left, sliding.sinks, sliding.mask.kind) == ("float16", 3, True, "document")
    assert specs["full_attention/bfloat16"].window_left is None
    with pytest.raises(ValueError, match="'float32' is not supported"):
        integration.kernel_specs(config, dtypes=("float32",))
    with pytest.raises(ValueError, match="chunked_attention layers are not run on kernels"):
        integration.kernel_specs({"model_type": "llama4_text"})
    with pytest.raises(ValueError, match="olmo.*fa4gen.hf cannot map the config"):
        integration.kernel_specs({"model_type": "olmo"})


# ----------------------------------------------------------------------------- the kernel path
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(kernels, family):
    ours, theirs = _family(family)
    ids = _ids()
    left, right = torch.ones_like(ids), torch.ones_like(ids)
    left[0, :3] = 0
    right[1, 8:] = 0
    masks = [left, right]
    if family == "llama":  # a padded token inside a row: the kernels see the row's tokens packed,
        holes = right.clone()  # which only windows could tell apart (as in transformers' flash path)
        holes[0, 4] = 0
        masks.append(holes)
    with torch.no_grad():
        _close(ours(ids).logits, theirs(ids).logits)
        assert set(kernels.calls) == EXPECTED_SPECS[family]
        kernels.calls.clear()
        for mask in masks:
            _close(ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits, mask.bool())
        assert set(kernels.calls) == {spec + " document" for spec in EXPECTED_SPECS[family]}


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_packed_sequences(kernels, family):
    """Sequences packed in one row, marked by position ids (a step other than +1 starts one, as
    transformers' masks read them) or by flash-attention's cu_seq_lens keywords, give each
    sequence's logits as if it ran alone (GPT-OSS's own SDPA / eager masks ignore packing)."""
    ours, theirs = _family(family)
    ids = _ids(batch=1, seqlen=14)
    bounds = (0, 6, 9, 14)
    positions = torch.cat([torch.arange(end - start) for start, end in zip(bounds, bounds[1:])])[None]
    with torch.no_grad():
        alone = torch.cat([theirs(ids[:, a:b], use_cache=False).logits for a, b in zip(bounds, bounds[1:])], 1)
        _close(ours(ids, position_ids=positions, use_cache=False).logits, alone)
        assert set(kernels.calls) == {spec + " document" for spec in EXPECTED_SPECS[family]}
        cu = torch.tensor(bounds, dtype=torch.int32)
        flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
        _close(ours(ids, position_ids=positions, use_cache=False, **flash).logits, alone)
        kernels.calls.clear()  # positions 0..13: one sequence, the dense kernel
        _close(ours(ids, use_cache=False).logits, theirs(ids, use_cache=False).logits)
        assert set(kernels.calls) == EXPECTED_SPECS[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_with_dynamic_cache(kernels, family):
    """Greedy generation from left-padded prompts: prefill, then one query against the cache
    (bottom-right aligned; sliding layers' caches keep W - 1 keys), each step's logits compared."""
    ours, theirs = _family(family)
    ids = _ids()
    padding = torch.ones_like(ids)
    padding[1, :4] = 0
    settings = dict(attention_mask=padding, max_new_tokens=7, do_sample=False, return_dict_in_generate=True,
                    output_logits=True)  # fmt: skip
    with torch.no_grad():
        mine, reference_run = ours.generate(ids, **settings), theirs.generate(ids, **settings)
    assert torch.equal(mine.sequences, reference_run.sequences)
    for step, (a, b) in enumerate(zip(mine.logits, reference_run.logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=lambda m, step=step: f"step {step}: {m}")
    assert len(kernels.calls) == 2 * 7  # every layer, every step: prefill and 6 decode steps


def test_generate_unpadded_batch_runs_dense_kernels(kernels):
    ours, theirs = _family("mistral")
    ids = _ids(seqlen=9)
    settings = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        mine = ours.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        reference_run = theirs.generate(ids, attention_mask=torch.ones_like(ids), **settings)
    assert torch.equal(mine.sequences, reference_run.sequences)
    torch.testing.assert_close(torch.stack(mine.logits), torch.stack(reference_run.logits), rtol=0, atol=ATOL)
    assert set(kernels.calls) == EXPECTED_SPECS["mistral"]  # no padding found: no document masks


def test_compiled_model_has_no_graph_breaks_or_recompiles(kernels, monkeypatch):
    """torch.compile(fullgraph=True, dynamic=True) traces the dense and the padded kernel paths:
    no graph breaks, and three sequence lengths share one graph (the eager backend: this checks
    Dynamo's tracing, which Inductor does not change)."""
    ours, _ = _family("gpt_oss")

    def dense(ids):
        return ours(ids, use_cache=False).logits

    def padded(ids, mask):
        return ours(ids, attention_mask=mask, use_cache=False).logits

    torch._dynamo.reset()
    with torch.no_grad():
        for function, args in ((dense, (_ids(),)), (padded, (_ids(), torch.ones(2, 11, dtype=torch.long)))):
            explained = torch._dynamo.explain(function)(*args)
            assert explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        compiled = [torch.compile(f, fullgraph=True, dynamic=True, backend="eager") for f in (dense, padded)]
        for seqlen in (9, 13, 21):
            ids = _ids(seqlen=seqlen)
            mask = torch.ones_like(ids)
            mask[0, :3] = 0
            mask[1, -2:] = 0
            _close(compiled[0](ids), dense(ids))
            _close(compiled[1](ids, mask), padded(ids, mask), mask.bool())
    torch._dynamo.reset()
    assert any("document" in call for call in kernels.calls)


# ----------------------------------------------------------------------------- fallbacks
def _fallback_messages(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, integration.FallbackWarning)]


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])
def test_cpu_float32_falls_back_with_one_warning_per_layer_type(fallbacks, family):
    """CPU tensors run the model's own attention (eager where SDPA drops the softcap) with the
    masks transformers makes: windows, padding and packed sequences as its SDPA / eager masks."""
    ours, theirs = _family(family)
    ids = _ids()
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]]).expand(2, -1)
    runs = [dict(), dict(attention_mask=padding), dict(position_ids=positions, use_cache=False)]
    with torch.no_grad():
        for _ in range(2):  # two passes, two layers of each type: still one warning per reason
            for run in runs:
                torch.testing.assert_close(ours(ids, **run).logits, theirs(ids, **run).logits, rtol=0, atol=1e-6)
    implementation = FAMILIES[family][1]
    assert sorted(_fallback_messages(fallbacks)) == [
        f"fa4gen: {family} {kind} layers run on transformers' {implementation} attention, not fa4gen kernels: "
        "tensors on cpu: fa4gen kernels run on CUDA GPUs"
        for kind in ("full_attention", "sliding_attention")
    ]


def test_layer_disagreeing_with_its_config_falls_back(kernels):
    """A layer whose scaling differs from what fa4gen.hf maps its config to runs on SDPA (its
    own scaling), with a warning that names both values; the other layer stays on the kernel."""
    ours, theirs = _family("llama")
    for model in (ours, theirs):
        model.model.layers[1].self_attn.scaling = 0.3
    ids = _ids()
    with torch.no_grad(), pytest.warns(integration.FallbackWarning) as caught:
        _close(ours(ids).logits, theirs(ids).logits)
    (message,) = _fallback_messages(caught)
    assert message.endswith(
        "llama full_attention layers run on transformers' sdpa attention, not fa4gen kernels: "
        "the layer scales q.k by 0.3; fa4gen.hf maps the config to softmax_scale 0.176777"
    )
    assert len(kernels.calls) == 1


def test_gradients_output_attentions_and_dropout_fall_back(kernels):
    ours, theirs = _family("gpt_oss")
    ids = _ids()
    with pytest.warns(integration.FallbackWarning, match="gradients are needed"):
        logits = ours(ids).logits
    logits.sum().backward()  # the fallback is differentiable
    assert ours.model.layers[0].self_attn.sinks.grad is not None
    with torch.no_grad(), pytest.warns(integration.FallbackWarning, match="output_attentions=True"):
        attentions = ours(ids, output_attentions=True).attentions
    assert attentions[0].shape == (2, 4, 11, 11)  # the eager fallback returns the weights
    torch.testing.assert_close(attentions[0], theirs(ids, output_attentions=True).attentions[0])
    ours.config.attention_dropout = 0.1
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.1
    ours.train()
    with torch.no_grad(), pytest.warns(integration.FallbackWarning, match="attention dropout 0.1"):
        ours(ids)
    assert kernels.calls == []


def test_config_fa4gen_cannot_map_runs_sdpa_exactly(fallbacks):
    """A model type fa4gen.hf does not map: the mask function hands over SDPA's own masks, so
    padding and all come out as with attn_implementation="sdpa"."""
    config = dict(TINY, model_type="olmo", num_attention_heads=4)
    ours, theirs = _pair(config, "sdpa")
    ids = _ids()
    padding = torch.ones_like(ids)
    padding[0, :5] = 0
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, attention_mask=padding).logits, theirs(ids, attention_mask=padding).logits, rtol=0, atol=0
        )
    (message,) = _fallback_messages(fallbacks)
    assert "fa4gen: olmo attention layers run on transformers' sdpa attention" in message
    assert "fa4gen.hf cannot map the config (config: model_type: 'olmo' is not supported" in message


def test_static_cache_falls_back_where_keys_run_past_the_tokens(kernels):
    """A static cache's full layers hold max_cache_len keys: SDPA with transformers' own mask.
    Its sliding layers pass exactly the keys a query sees, so they stay on kernels."""
    ours, theirs = _family("qwen3")
    ids = _ids(seqlen=6)
    settings = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", return_dict_in_generate=True,
                    output_logits=True, attention_mask=torch.ones_like(ids))  # fmt: skip
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", integration.FallbackWarning)
        mine = ours.generate(ids, **settings)
    with torch.no_grad():
        reference_run = theirs.generate(ids, **settings)
    assert torch.equal(mine.sequences, reference_run.sequences)
    torch.testing.assert_close(torch.stack(mine.logits), torch.stack(reference_run.logits), rtol=0, atol=ATOL)
    (message,) = _fallback_messages(caught)
    assert "qwen3 full_attention layers run on transformers' sdpa attention" in message
    assert "a 4D attention mask (a custom mask, or a static cache whose keys run past the tokens seen)" in message
    assert set(kernels.calls) == {"float32 d32 gqa2 causal window(3,0)"}


# ----------------------------------------------------------------------------- GPU
def _example():
    spec = importlib.util.spec_from_file_location("transformers_model_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt-oss-tiny", "qwen3-tiny"])
def test_gpu_logits_and_tokens_per_second(name):
    """The example's models in bf16 on the kernels: logits within bf16 tolerance of transformers'
    own attention (fa4gen's error against float32 at most twice the reference's), with and
    without padding; generation speed reported."""
    example = _example()
    integration.register()
    models = {
        "fa4gen": example.build(name, "fa4gen"),
        "reference": example.build(name, example.REFERENCE[name]),
        "float32": example.build(name, "eager", dtype=torch.float32),
    }
    ids = torch.randint(0, 2048, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    padding = torch.ones_like(ids)
    padding[1, :100] = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", integration.FallbackWarning)
        for mask in (None, padding):
            logits = {key: model(ids, attention_mask=mask).logits for key, model in models.items()}
            valid = padding.bool() if mask is not None else None
            assert example.compare(f"{name}, mask {mask is not None}", logits, example.REFERENCE[name], valid)
        speed = example.tokens_per_second(models["fa4gen"], ids[:1, :256], 64)
    print(f"{name}: {speed:.0f} tokens/s with fa4gen kernels")
    assert speed > 0


@pytest.mark.gpu
def test_gpu_compiled_model_no_graph_breaks_no_recompiles(monkeypatch):
    example = _example()
    integration.register()
    model = example.build("gpt-oss-tiny", "fa4gen")

    def forward(ids):
        return model(ids, use_cache=False).logits

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", integration.FallbackWarning)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(forward)(torch.randint(0, 2048, (2, 200), device="cuda"))
        assert explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        compiled = torch.compile(forward, fullgraph=True, dynamic=True)
        for seqlen in (200, 333, 517):
            ids = torch.randint(0, 2048, (2, seqlen), device="cuda")
            started = time.perf_counter()
            out = compiled(ids)
            torch.testing.assert_close(out.float(), forward(ids).float(), rtol=0, atol=5e-2)
            print(f"seqlen {seqlen}: compiled call {time.perf_counter() - started:.2f} s")
    torch._dynamo.reset()
