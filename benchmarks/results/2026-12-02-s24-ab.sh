#!/bin/bash
# session 24's A/Bs on the device (carry .devrt and build/ab; see 2026-12-02-s23-ab.sh for the form).
# Builds (FA4GEN_CACHE_DIR=/tmp/cX python benchmarks/ab_kernels.py build build/ab/X REGEX [FIELD=VALUE]):
#   A  'd256|d192|d128 S=(512|2048|16384)$|d128 causal S=(512|16384)$|d64 S=(512|4096)$|d64 causal S=(1024|16384)$|d96 S=(1024|4096)$|gqa8 S=2048|Gemma|documents'
#      (the planner's plans);  B  the same with q_per_warpgroup=true
#   C  'd256|d192' q_per_warpgroup=true q_prefetch=true
#   D  'd256 |d256 causal|d192/128 causal' with the planner's q_per_warpgroup and O over V's
#      producer wait for warpgroup 1's previous Q rows (sm90_fwd.load_q)
#   F0..F8  'd256 causal S=512$': the planner's plan (F0) and, against it, heavy-first order (F1),
#      one CTA per tile (F2), ping-pong (F3), one loop for every key tile (F4), the P.V wait pinned
#      (F5), the next Q prefetched (F6), causal pairs to the end (F7), O in a buffer taken in turn (F8)
#   L0, L1  'lse' (d128 with LSE, S=512/2048/16384): the planner's chained plan (L0) against
#      unchained query tiles (L1, chain_query_tiles=false)
source .devrt/setup.sh
if [ "${JOBS:-}" = tune ]; then
  for v in F1 F2 F3 F4 F5 F6 F7 F8; do
    python3 -W ignore benchmarks/ab_kernels.py both build/ab/F0 "build/ab/$v" 8 > "$OUT/s24c-ab-$v.log" 2>&1
    printf '%s ' "$v" && grep -E "both orders" "$OUT/s24c-ab-$v.log" | tail -n 1
  done
  exit 0
fi
for job in ${JOBS:-qwg}; do
  case $job in
    qwg) set -- s24a-ab-q-per-warpgroup B '';;
    qwgpf) set -- s24a-ab-q-per-warpgroup-prefetch C 'd256|d192';;
    lse) set -- s24g-ab-lse-unchained L1 'lse';;
    qwgv) set -- s24b-ab-q-per-warpgroup-over-v D 'd256 |d256 causal|d192/128 causal';;
  esac
  python3 -W ignore benchmarks/ab_kernels.py both "build/ab/${BASE:-A}" "build/ab/$2" 6 "$3" > "$OUT/$1.log" 2>&1
  printf '== %s\n' "$1" && grep -E "both orders|->" "$OUT/$1.log" | tail -n 70
done
