"""Cold-start figures of a process that finds its kernel in the cache (run on the GPU machine).

    FA4GEN_CACHE_DIR=... python benchmarks/coldstart.py specs/llama3-8b.yaml [--repeat 3]

Each repeat is a fresh Python process: import torch and create the CUDA context first (any
PyTorch program pays those), then time import fa4gen, fa4gen.compile() (cache hit + load), the
first call and a steady-state call of the kernel. The first call minus the steady call is what
loading costs beyond the kernel's own run time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t0 = time.perf_counter()
import fa4gen
t1 = time.perf_counter()
spec = fa4gen.load_spec(sys.argv[1])
attn = fa4gen.compile(spec)
t2 = time.perf_counter()
hq = 8 * spec.qhead_per_kvhead
dt = getattr(torch, spec.dtype)
q = torch.randn(1, 512, hq, spec.head_dim, device="cuda", dtype=dt)
k = torch.randn(1, 512, 8, spec.head_dim, device="cuda", dtype=dt)
v = torch.randn(1, 512, 8, spec.dv, device="cuda", dtype=dt)
torch.cuda.synchronize(); t3 = time.perf_counter()
attn(q, k, v); torch.cuda.synchronize(); t4 = time.perf_counter()
attn(q, k, v); torch.cuda.synchronize(); t5 = time.perf_counter()
print(json.dumps({"import_ms": 1e3 * (t1 - t0), "compile_hit_ms": 1e3 * (t2 - t1),
                  "first_call_ms": 1e3 * (t4 - t3), "steady_call_ms": 1e3 * (t5 - t4),
                  "compiler_imported": "cutlass.cute" in sys.modules}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.repeat):
        out = subprocess.run([sys.executable, "-c", CHILD, args.spec], capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["load_beyond_kernel_ms"] = row["compile_hit_ms"] + row["first_call_ms"] - row["steady_call_ms"]
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
