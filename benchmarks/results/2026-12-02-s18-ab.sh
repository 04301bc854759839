#!/bin/bash
# session 18 A/Bs: run on the device from the repo root
source .devrt/setup.sh
SPLIT='^bfloat16 (d64 S=(2048|4096|16384)|d128 S=(4096|8192|16384)|d128 gqa4 S=4096|d192/128 S=(2048|4096|16384)|d256 S=(4096|8192|16384)|d96 S=(4096|8192|16384))$'
SHORT='^bfloat16 (d128 S=(512|1024|2048)|d256 S=(1024|2048)|d96 S=2048|d192/128 S=1024)$'
R=${R:-10}
ab() { # name old new pattern
  python3 -W ignore benchmarks/ab_kernels.py run build/ab/$2 build/ab/$3 $R "$4" > $OUT/$1-1.log 2>&1
  python3 -W ignore benchmarks/ab_kernels.py run build/ab/$3 build/ab/$2 $R "$4" > $OUT/$1-2.log 2>&1
  echo "== $1"; grep -h 'geometric\|Error\|error:' $OUT/$1-*.log | grep -v 'vs fp32' | head -6
}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
for job in ${JOBS:-merge forced carry turnless kv3}; do
  case $job in
    merge) ab merge old new "$SPLIT";;
    forced) ab forced old forced "$SHORT";;
    carry) ab carry old carry "$SHORT";;
    turnless) ab turnless old64 c64turnless "";;
    kv3) ab kv3 old64 c64kv3 "";;
    carry2) ab carry2 old2 carry2 "";;
    carry3) ab carry3 old carry3 "^bfloat16 (d128 S=(512|1024|2048)|d256 S=(1024|2048))$";;
    forced3) ab forced3 old forced3 "^bfloat16 (d128 S=(512|1024|2048)|d256 S=(1024|2048))$";;
    turnless128) ab turnless128 cur turnless128 "^bfloat16 (d128 S=(512|1024|2048)|d128 gqa4 S=4096)$";;
    nopp128) ab nopp128 cur nopp128 "^bfloat16 (d128 S=(512|1024|2048)|d128 gqa4 S=4096)$";;
    pp256) ab pp256 cur pp256 "^bfloat16 d256";;
    new3) ab new3 new new3 "^bfloat16 (d128 S=(4096|16384)|d64 S=(2048|16384))$";;
  esac
done
