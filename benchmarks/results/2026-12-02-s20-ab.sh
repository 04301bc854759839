#!/bin/bash
# session 20 A/Bs: run on the device from the repo root (carry .devrt and build/ab);
# each pair in both orders, 8 rounds per order (ab_kernels.py both)
source .devrt/setup.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
ab() { # name A B regex
  python3 -W ignore benchmarks/ab_kernels.py both build/ab/$2 build/ab/$3 ${R:-8} "$4" > $OUT/$1.log 2>&1
  echo "== $1"; tail -n 12 $OUT/$1.log
}
for job in ${JOBS:-resc split16}; do
  case $job in
    resc) ab s20a-ab-d64c-rescale cur resc '^bfloat16 d64 causal S=';;
    split16) ab s20a-ab-d128-split16 cur128 split16 '^bfloat16 d128( gqa8)? S=2048$';;
    e1) ab s20b-ab-stage-slice base e1 '';;
    e4) ab s20c-ab-q-aligned base e4 "";;
    t5) ab s20f-ab-d64-variants base e5 '';;
  esac
done
