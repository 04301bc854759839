"""fa4gen in training: a small causal transformer trained with fa4gen's attention and with SDPA.

    python examples/training.py            # on a GPU machine: 300 steps each, loss curves side by side
    python examples/training.py --cpu      # anywhere: build what training runs into the cache

Autograd runs the spec's forward with its LSE and its backward kernel (fa4gen.compile does it
for you); `fa4gen warm --training specs/` fills a cache with them ahead of time.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import fa4gen
from fa4gen.api import build_training

# 8 query heads over 2 KV heads of 64: the attention every layer below runs
SPEC = fa4gen.AttentionSpec(head_dim=64, qhead_per_kvhead=4, causal=True)
VOCAB, WIDTH, HEADS, KV_HEADS, DEPTH, SEQ, BATCH = 256, 512, 8, 2, 2, 256, 16


class Layer(nn.Module):
    """Pre-norm attention and MLP; the attention is ``attend(q, k, v)`` on (B, S, H, 64) bf16."""

    def __init__(self, attend):
        super().__init__()
        self.attend = attend
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.head_dim = WIDTH // HEADS
        self.qkv = nn.Linear(WIDTH, (HEADS + 2 * KV_HEADS) * self.head_dim, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([HEADS * d, KV_HEADS * d, KV_HEADS * d], -1)
        q = q.reshape(b, s, HEADS, d).to(torch.bfloat16)
        k, v = (t.reshape(b, s, KV_HEADS, d).to(torch.bfloat16) for t in (k, v))
        x = x + self.proj(self.attend(q, k, v).float().reshape(b, s, WIDTH))
        return x + self.mlp(self.norm2(x))


def sdpa(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


def train(attend, steps: int = 300) -> list[float]:
    """The loss of each step: a next-token task (each token's successor fixed by a random table),
    weights, data and order fixed by seeds, so two runs differ only by their attention."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), *[Layer(attend) for _ in range(DEPTH)], nn.LayerNorm(WIDTH))
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    model, head = model.cuda(), head.cuda()
    optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    step_of = torch.randint(1, 8, (VOCAB,), generator=gen, device="cuda")  # next = token + step_of[token]
    losses = []
    for _ in range(steps):
        tokens = [torch.randint(0, VOCAB, (BATCH, 1), generator=gen, device="cuda")]
        for _ in range(SEQ):
            tokens.append((tokens[-1] + step_of[tokens[-1]]) % VOCAB)
        tokens = torch.cat(tokens, dim=1)
        logits = head(model(tokens[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def cross_compile() -> None:
    started = time.perf_counter()
    forward, backward = build_training(SPEC, "sm_90a")
    fa4gen.build(SPEC, "sm_90a")  # (fa4gen.compile(SPEC) looks the plain forward up too)
    print(backward.plan.describe())
    state = "compiled" if forward.any_built_now or backward.built_now else "cache hit"
    print(f"{state} in {time.perf_counter() - started:.2f} s -> {backward.entry.path}")


def run_on_gpu() -> None:
    curves = {"fa4gen": train(fa4gen.compile(SPEC)), "sdpa": train(sdpa)}
    print("step   fa4gen     sdpa")
    for step in range(0, 300, 30):
        print(f"{step:4}  {curves['fa4gen'][step]:.5f}  {curves['sdpa'][step]:.5f}")
    gap = max(abs(a - b) for a, b in zip(*curves.values()))
    print(f"largest per-step difference {gap:.2e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="build the kernels only (no GPU needed)")
    args = parser.parse_args()
    if args.cpu or not torch.cuda.is_available():
        cross_compile()
    else:
        run_on_gpu()
