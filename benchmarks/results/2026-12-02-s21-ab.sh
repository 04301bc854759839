#!/bin/bash
# session 21 A/Bs: run on the device from the repo root (carry .devrt and build/ab);
# each pair in both orders, R rounds per order (ab_kernels.py both)
source .devrt/setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
ab() { # name A B regex
  python3 -W ignore benchmarks/ab_kernels.py both build/ab/$2 build/ab/$3 ${R:-6} "$4" > $OUT/$1.log 2>&1
  echo "== $1"; grep -E "both orders|->" $OUT/$1.log | tail -n ${TAIL:-70}
}
for job in ${JOBS:-hoist}; do
  case $job in
    hoist) ab s21a-ab-operands-before-waits base hoist '';;
    qrs) ab s21c-ab-d128-q-registers base qrs 'd128|alibi|expression|chunked|prefix|documents|Streaming|causal window|dense';;
  esac
done
