#!/bin/bash
# session 22's A/B, run on the device from the repo root (carry .devrt and build/ab): the stale
# max (build/ab/stale: ab_kernels.py build ... '' stale_max=true rescale_threshold=8.0) against
# the kernels of 616a638 (build/ab/base), both orders, 6 rounds per order
source .devrt/setup.sh
python3 -W ignore benchmarks/ab_kernels.py both build/ab/base build/ab/stale 6 '' > "$OUT/s22a-ab-stale-max.log" 2>&1
grep -E "both orders|->|reference" "$OUT/s22a-ab-stale-max.log" | tail -n 200
