"""Sample SM clock, power and throttle reasons while one A/B build's kernel runs back to back."""

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import ab_kernels as A
import torch

for label in sys.argv[2:]:
    k = A._load(Path(sys.argv[1]), label)
    inputs, args, flops = A._workload(label, k.spec)
    q, kk, v = inputs[0]
    for _ in range(20):
        k(q, kk, v, **args)
    torch.cuda.synchronize()
    smi = subprocess.Popen(
        [
            "nvidia-smi",
            "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active,temperature.gpu",
            "--format=csv,noheader",
            "-lms",
            "100",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    t0 = time.time()
    n = 0
    while time.time() - t0 < 3.0:
        for _ in range(10):
            k(q, kk, v, **args)
            n += 1
        torch.cuda.synchronize()
    smi.terminate()
    out = smi.communicate()[0].strip().splitlines()
    print(f"== {label}: {n} launches; samples (sm clock, power, reasons, temp):")
    for line in out[5:25:3]:
        print("   ", line)
