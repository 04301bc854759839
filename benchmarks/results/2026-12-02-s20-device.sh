#!/bin/bash
# session 20 device jobs: run on the device from the repo root after `bash .devfull/a/unpack.sh`
# prof: Nsight Compute with per-instruction stall samples of the cells below;
# final: the d64 A/B of the Q view (build/ab/base against build/ab/e5, both orders), then the
# GPU tests and the grid (benchmarks/device_session.sh run tests,grid)
set +u; source .devfull/b/setup.sh > /tmp/setup.log 2>&1; set -u
chmod -R go-w .devcache
export FA4GEN_CACHE_DIR="$PWD/.devcache/kernels" FA4GEN_TOOLCHAIN="$(cat .devcache/toolchain)" FA4GEN_NO_COMPILE=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader | tee $OUT/env.txt
prof() {
  mkdir -p /tmp/prof
  for cell in "${@}"; do
    # shellcheck disable=SC2086
    python3 benchmarks/ncu_counters.py $cell --out-dir /tmp/prof >> $OUT/profile.txt 2>&1 || true
  done
  grep -E "^=====|Duration|Issue Slots Busy" $OUT/profile.txt
  tar czf $OUT/prof.tgz -C /tmp prof
}
case "${1:-}" in
  prof) prof "--head-dim 128 --seqlen 2048 --impls fa4gen" "--head-dim 64 --seqlen 16384 --causal --impls fa4gen,fa4" \
             "--head-dim 64 --seqlen 16384 --impls fa4gen,fa4";;
  final)
    python3 -W ignore benchmarks/ab_kernels.py both build/ab/base build/ab/e5 8 '' > $OUT/s20d-ab-d64-q-view.log 2>&1
    tail -n 13 $OUT/s20d-ab-d64-q-view.log
    bash benchmarks/device_session.sh run tests,grid;;
esac
