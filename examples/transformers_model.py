"""A transformers model on fa4gen kernels: ``attn_implementation="fa4gen"`` against transformers' own.

    python examples/transformers_model.py            # on a GPU: logits, padding, generation, tokens/s
    python examples/transformers_model.py --cpu      # anywhere: each layer type's spec, cross-compiled

Small models built from configs (random weights, nothing downloaded): a GPT-OSS-like one (sinks,
sliding-window and full layers, 8 query heads per key/value head, head dim 64), compared with
transformers' eager attention (its SDPA path has no sinks), and a Qwen3-like one (4 query heads
per key/value head, head dim 128), compared with SDPA. Logits agree when fa4gen's error against a
float32 copy of the model is at most twice the reference's own bfloat16 error (plus a small floor).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import fa4gen
from fa4gen.integrations import transformers as fa4gen_transformers

# The models (and so the kernels: fa4gen_transformers.kernel_specs(config) for each) this
# example and tests/test_integration_transformers.py's GPU tests run.
MODEL_CONFIGS = {
    "gpt-oss-tiny": dict(
        model_type="gpt_oss",
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=512,
        num_hidden_layers=4,  # sliding, full, sliding, full
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=128,
        # one expert: top-k routing flips between bf16 and float32 would swamp the attention's
        # differences that the comparison is about
        num_local_experts=1,
        num_experts_per_tok=1,
    ),
    "qwen3-tiny": dict(
        model_type="qwen3",
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    ),
}
# what each model is compared with: transformers' SDPA attention drops GPT-OSS's sinks
REFERENCE = {"gpt-oss-tiny": "eager", "qwen3-tiny": "sdpa"}
ERROR_FLOOR = 1e-2  # logits are O(1): below this, bf16 rounding of the last layers dominates


def build(name: str, implementation: str, dtype=torch.bfloat16, device="cuda", seed: int = 0):
    """The example model ``name`` with random weights (the same for every ``seed``)."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**MODEL_CONFIGS[name])
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.float32)
    return model.to(device=device, dtype=dtype).eval()


def compare(label: str, logits: dict, reference: str, valid=None) -> bool:
    """Print the logits' differences (keys fa4gen, reference, float32); True where fa4gen is
    within bf16 tolerance."""
    exact = logits["float32"]
    pick = (lambda t: t[valid]) if valid is not None else (lambda t: t)
    ours = (pick(logits["fa4gen"]).float() - pick(exact)).abs().max().item()
    theirs = (pick(logits["reference"]).float() - pick(exact)).abs().max().item()
    versus = (pick(logits["fa4gen"]).float() - pick(logits["reference"]).float()).abs().max().item()
    ok = ours <= 2 * theirs + ERROR_FLOOR
    print(
        f"  {label}: max |fa4gen - {reference}| = {versus:.3e}; against float32: fa4gen {ours:.3e}, "
        f"{reference} {theirs:.3e} -> {'within' if ok else 'OUTSIDE'} bf16 tolerance"
    )
    return ok


def tokens_per_second(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """Greedy prefill + decode of ``new_tokens``, after a warm-up run (kernels compiled or loaded)."""
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
    torch.cuda.synchronize()
    return prompt.shape[0] * new_tokens / (time.perf_counter() - started)


def run_on_gpu(name: str) -> bool:
    reference = REFERENCE[name]
    print(f"{name}: fa4gen against transformers' {reference} attention (bf16, CUDA)")
    models = {
        "fa4gen": build(name, "fa4gen"),
        "reference": build(name, reference),
        "float32": build(name, "eager", dtype=torch.float32),
    }
    vocab = MODEL_CONFIGS[name]["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 400), generator=generator).cuda()
    padding = torch.ones_like(ids)
    padding[1, :150] = 0  # the second prompt is shorter: left padding, as for generation
    ok = True
    with torch.no_grad():
        ok &= compare("logits (2 x 400 tokens)", {key: model(ids).logits for key, model in models.items()}, reference)
        padded = {key: model(ids, attention_mask=padding).logits for key, model in models.items()}
        ok &= compare("logits with left padding", padded, reference, valid=padding.bool())
        settings = dict(attention_mask=padding, max_new_tokens=16, do_sample=False)
        ours = models["fa4gen"].generate(ids, **settings)[:, ids.shape[1] :]
        theirs = models["reference"].generate(ids, **settings)[:, ids.shape[1] :]
        print(f"  greedy tokens: fa4gen {ours[0, :8].tolist()}..., {reference} {theirs[0, :8].tolist()}...")
        print(f"  {(ours == theirs).float().mean().item():.0%} of the 2 x 16 generated tokens agree")
        prompt = torch.randint(0, vocab, (1, 512), generator=generator).cuda()
        for key in ("fa4gen", "reference"):
            speed = tokens_per_second(models[key], prompt, 128)
            label = "fa4gen" if key == "fa4gen" else reference
            print(f"  {label}: {speed:.0f} tokens/s (prefill 512 + decode 128, batch 1)")
    return ok


def cross_compile(name: str) -> None:
    """Register, build the model on the CPU, show each layer type's specs and cross-compile them."""
    config = AutoConfig.for_model(**MODEL_CONFIGS[name])
    print(f"{name} ({config.model_type}, layer types {sorted(set(getattr(config, 'layer_types', None) or ['?']))})")
    for key, spec in fa4gen_transformers.kernel_specs(config).items():
        started = time.perf_counter()
        result = fa4gen.build(spec, "sm_90a")
        state = "compiled" if result.built_now else "cache hit"
        print(f"  {key}: {spec.summary()}: {state} in {time.perf_counter() - started:.2f} s")
    model = build(name, "fa4gen", dtype=torch.float32, device="cpu")
    reference = build(name, REFERENCE[name], dtype=torch.float32, device="cpu")
    ids = torch.randint(0, config.vocab_size, (1, 32))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fa4gen_transformers.FallbackWarning)
        difference = (model(ids).logits - reference(ids).logits).abs().max().item()
    for warning in caught:
        print(f"  warning: {warning.message}")
    print(f"  on the CPU every layer falls back: max |logits - {REFERENCE[name]}'s| = {difference:.1e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="no GPU: show and cross-compile the specs")
    parser.add_argument("--model", choices=sorted(MODEL_CONFIGS), action="append", help="default: all")
    args = parser.parse_args()
    fa4gen_transformers.register()
    names = args.model or list(MODEL_CONFIGS)
    if args.cpu or not torch.cuda.is_available():
        for name in names:
            cross_compile(name)
        return 0
    results = [run_on_gpu(name) for name in names]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
