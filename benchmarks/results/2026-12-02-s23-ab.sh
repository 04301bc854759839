#!/bin/bash
# session 23's A/Bs, run on the device from the repo root (carry .devrt and build/ab), each pair
# in both orders, 6 rounds per order (ab_kernels.py both); JOBS picks them. Builds
# (FA4GEN_CACHE_DIR=/tmp/cX python benchmarks/ab_kernels.py build build/ab/X REGEX [FIELD=VALUE]):
#   A  'd192|d256|d96 S=(2048|4096)|Gemma'  (the planner's plans of e6effbe)
#   B  the same with q_prefetch=true
#   C  'd256 S=(512|1024|2048)$|d192/128 S=(512|1024)$' q_prefetch=true o_staging='"over_q"'
#   D  'd192|d256|Gemma' o_staging='"over_v"'
#   E  the same with q_prefetch=true
source .devrt/setup.sh
for job in ${JOBS:-prefetch}; do
  case $job in
    prefetch) set -- s23a-ab-q-prefetch B '';;
    overq) set -- s23a-ab-q-prefetch-over-q C 'd256 S=(512|1024|2048)$|d192/128 S=(512|1024)$';;
    overv) set -- s23c-ab-over-v D 'd192|d256|Gemma';;
    overvpf) set -- s23c-ab-over-v-prefetch E 'd192|d256|Gemma';;
  esac
  python3 -W ignore benchmarks/ab_kernels.py both build/ab/A "build/ab/$2" 6 "$3" > "$OUT/$1.log" 2>&1
  printf '== %s\n' "$1" && grep -E "both orders|->" "$OUT/$1.log" | tail -n 70
done
