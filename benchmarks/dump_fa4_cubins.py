"""flash-attn-4's Hopper kernels for the cells fa4gen trails, kept as cubins for comparison.

    mkdir -p $OUT/fa4dump && CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=$OUT/fa4dump \\
        python3 benchmarks/dump_fa4_cubins.py          # on the GPU machine, after .devfull/b/setup.sh

Then here: `nvdisasm -c FILE.cubin` for the SASS (tile shapes from the HGMMA shapes, register
split from USETMAXREG). Session 8 found: d96 runs 192x144 tiles on 3 warpgroups with P through
shared memory; d128 and d192 (dv 128) run 128x128 on 2 warpgroups at 24 / 240 registers; d64
causal 192x128 on 3 warpgroups; the d192 causal mask uses R2P bit masks.
"""

from __future__ import annotations

import torch
from flash_attn.cute import flash_attn_func

CELLS = ((96, 96, False, 16384), (128, 128, False, 16384), (64, 64, True, 8192), (192, 128, True, 4096))


def main() -> None:
    for d, dv, causal, seqlen in CELLS:
        heads = 2048 // d
        q = torch.randn(16384 // seqlen, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn_like(q)
        v = torch.randn(16384 // seqlen, seqlen, heads, dv, device="cuda", dtype=torch.bfloat16)
        flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
        print(f"compiled d{d}/{dv} {'causal' if causal else 'non-causal'} S={seqlen}", flush=True)


if __name__ == "__main__":
    main()
