#!/bin/bash
# session 19 A/Bs: run on the device from the repo root
source .devrt/setup.sh
R=${R:-8}
ab() { # name old new pattern
  python3 -W ignore benchmarks/ab_kernels.py run build/ab/$2 build/ab/$3 $R "$4" > $OUT/$1-1.log 2>&1
  python3 -W ignore benchmarks/ab_kernels.py run build/ab/$3 build/ab/$2 $R "$4" > $OUT/$1-2.log 2>&1
  echo "== $1"; grep -h 'geometric\|Error\|error:' $OUT/$1-*.log | grep -v 'vs fp32' | head -6
}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
for job in ${JOBS:-split16}; do
  case $job in
    qahead) ab qahead old new "${AB_RE:-}";;
    pin) ab pin new pin "^bfloat16 d128( gqa[48])? S=";;
    pin2) ab pin2 new pin2 "^bfloat16 d128( gqa[48])? S=";;
    pinold) ab pinold old pin "^bfloat16 d128( gqa[48])? S=";;
    split16) ab split16 cur split16 "";;
  esac
done
