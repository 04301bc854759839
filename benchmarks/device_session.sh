#!/usr/bin/env bash
# A device session's GPU work in few device calls, kernels compiled beforehand on this machine
# (the H200 image has no CuTe DSL compiler; see ../shared/device/README.md):
#
#   bash benchmarks/device_session.sh warm [LABELS]    # here (CPU): fill .devcache, about 15 min;
#                                                      # LABELS: schedule_options rows to add,
#                                                      # or `tests`: the GPU tests' kernels only,
#                                                      # or `pending`: what the parts dettests,
#                                                      # decodetests, detgroups, splits and decode
#                                                      # need (about 15 min, 32 MiB),
#                                                      # or `transposed`: what the part transposed
#                                                      # needs (about 6 min, 14 MiB)
#   device call 1, carry .devfull/a:                    bash .devfull/a/unpack.sh
#   device call 2 (within 30 s), carry .devfull/b .devrt .devcache:
#       bash benchmarks/device_session.sh run PARTS [SEQLENS LABELS]
#
# PARTS, comma-separated: tests (the GPU tests, gpu.log), decodetests (tests/test_gpu_decode.py only,
# decode-tests.log), decode (benchmarks/decode.py: DECODE_GRID quick or full, DECODE_MATCH,
# DECODE_PART i/k; decode.json and decode.txt), decodeab (those decode cells timed by a base tree and
# this one in the order base, new, new, base: DECODE_BASE names a folder holding the base tree's
# fa4gen/, templates/ and its kernels/; decodeab-*.json, compared), grid (the speed grid,
# grid-1.json and grid-2.json for `python benchmarks/run.py report`, ~300 s), variants
# (variants.json, ~60 s), profile (Nsight Compute counters of cells, fa4gen beside flash-attn-4:
# PROFILE holds benchmarks/ncu_counters.py's arguments, cells separated by ';', profile.txt), schedule
# (schedule_options rows SEQLENS x LABELS, schedule.txt, ~0.3 s
# a row; rows rank options only past this machine's 20% first-timing spread: decide with
# `schedule_options.py ab SEQLENS A,B` and again with B,A), ab (default against each of LABELS
# in both orders, combined; AB_SPEC: a regular expression the specs' summaries must match).
# dettests (tests/test_gpu_bwd.py's deterministic cases, grouped turns included, det-tests.log),
# detgroups (deterministic mode's cost, its plan with dq_grouped_turns at each dQ group count:
# DET_MATCH cells, det-groups.json/.md), splits (benchmarks/decode_splits.py --rule, splits.txt),
# firstcall (benchmarks/first_call.py, needs .devfull; FIRST_CALL_LIMIT seconds, first-call.*),
# splitcells (decode_splits.py's CELLS, splits-cells.txt), transposed (the backward computed
# transposed, dkv_split t: its GPU tests, t-tests.log, and its A/B against the default plan on
# the d192/128 cells, t-ab.json/.md), importtime (`python -X importtime` of
# `import fa4gen` three times, and the device's memory clock and bus width, device-props.txt).
# Everything lands under $OUT with env.txt. A call may run 600 s: split the parts over calls
# made while the machine is warm (each later call only re-sources the setup). DEVCACHE names the
# cache folder (default .devcache): a smaller one (.devbench: the decode kernels) fits one call
# beside .devfull/b and .devrt under the 64 MiB carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVCACHE="${DEVCACHE:-.devcache}"
CACHE="$DEVCACHE/kernels"

# deterministic mode's cells (benchmarks/backward.py --grid quick): dense and causal d96, causal d128
DET_MATCH="${DET_MATCH:-d96,d128 causal,d128 gqa4 causal}"
# the transposed backward's plan (gpu_cases.transposed_plan) and the cells its A/B times
TRANSPOSED_PLAN="dkv_split=t,keys_per_warpgroup=48"

warm() {
    rm -rf "$DEVCACHE" && mkdir -p "$CACHE"
    # every warm below writes the same cache: one after the other, never two at once
    if [ "${1:-}" = "pending" ]; then
        python tests/warm_gpu_cache.py --deterministic --decode "$CACHE"
        FA4GEN_CACHE_DIR="$CACHE" python benchmarks/backward.py warm --deterministic \
            --plan dq_grouped_turns=true --match "$DET_MATCH"
        FA4GEN_CACHE_DIR="$CACHE" python benchmarks/decode.py warm --grid full
    elif [ "${1:-}" = "transposed" ]; then
        python tests/warm_gpu_cache.py --transposed "$CACHE"
        FA4GEN_CACHE_DIR="$CACHE" python benchmarks/backward.py warm --grid full --plan "$TRANSPOSED_PLAN" --match d192
    else
        python tests/warm_gpu_cache.py "$CACHE"
    fi
    if [ "${1:-}" != "tests" ] && [ "${1:-}" != "pending" ] && [ "${1:-}" != "transposed" ]; then  # `warm tests`: only what the GPU tests need
        FA4GEN_CACHE_DIR="$CACHE" python benchmarks/run.py warm --grid full
        FA4GEN_CACHE_DIR="$CACHE" python benchmarks/variants.py warm
        if [ -n "${1:-}" ]; then
            FA4GEN_CACHE_DIR="$CACHE" python benchmarks/schedule_options.py warm "" "$1"
        fi
    fi
    # the GPU machine never reads kernel.ptx or kernel.cubin (it loads kernel.so): dropping them
    # keeps the carry under its 64 MiB limit
    fa4gen --cache-dir "$CACHE" cache drop kernel.ptx kernel.cubin
    # the GPU machine has no toolchain metadata: it reads the one that compiled the cache
    python -c "from fa4gen.toolchain import toolchain; t = toolchain(); \
print(f\"cutlass-dsl={t['cutlass_dsl']},cuda={t['cuda']}\")" > "$DEVCACHE/toolchain"
    du -sh --apparent-size "$DEVCACHE" .devrt .devfull/b  # the carry limit is 64 MiB with the tree
}

run() {
    : "${OUT:?run on the device machine, where \$OUT is set}"
    local parts=",${1:?PARTS: tests,decodetests,dettests,detgroups,transposed,splits,splitcells,importtime,firstcall,decode,grid,variants,profile,schedule,ab},"
    local seqlens="${2:-}" labels="${3:-}"
    # the full DSL and the peers where .devfull/b came (in this call or an earlier one), else the runtime
    local setup=.devrt/setup.sh
    [ -f .devfull/b/setup.sh ] && setup=.devfull/b/setup.sh
    set +u; source "$setup" > "$OUT/setup.log" 2>&1; set -u  # not written for nounset
    chmod -R go-w "$DEVCACHE"  # a cache others can write is refused
    export FA4GEN_CACHE_DIR="$PWD/$CACHE" FA4GEN_TOOLCHAIN="$(cat "$DEVCACHE/toolchain")" FA4GEN_NO_COMPILE=1
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > "$OUT/env.txt"
    if [[ $parts == *,tests,* ]]; then
        # every GPU test module (transformers' when .devhf installed it: `bash .devhf/setup.sh`)
        # shellcheck disable=SC2086  # GPU_TESTS: test files (a cache split in two runs half of them each)
        python3 -m pytest ${GPU_TESTS:-tests/test_gpu*.py tests/test_integration_*.py} -m gpu -q -p no:cacheprovider \
            --continue-on-collection-errors > "$OUT/gpu.log" 2>&1 || true
        tail -n 1 "$OUT/gpu.log"
    fi
    if [[ $parts == *,decodetests,* ]]; then
        python3 -m pytest tests/test_gpu_decode.py -m gpu -q -p no:cacheprovider > "$OUT/decode-tests.log" 2>&1 || true
        tail -n 1 "$OUT/decode-tests.log"
    fi
    if [[ $parts == *,dettests,* ]]; then
        python3 -m pytest tests/test_gpu_bwd.py -k deterministic -m gpu -q -p no:cacheprovider \
            > "$OUT/det-tests.log" 2>&1 || true
        tail -n 1 "$OUT/det-tests.log"
    fi
    if [[ $parts == *,detgroups,* ]]; then
        python3 benchmarks/backward.py run --deterministic --plan dq_grouped_turns=true --dq-groups 1,2,4,8 \
            --match "$DET_MATCH" --out "$OUT/det-groups.json" > "$OUT/det-groups.txt" 2>&1 || true
        python3 benchmarks/backward.py report "$OUT/det-groups.json" > "$OUT/det-groups.md" || true
        tail -n 6 "$OUT/det-groups.md"
    fi
    if [[ $parts == *,transposed,* ]]; then
        python3 -m pytest tests/test_gpu_bwd.py -k transposed -m gpu -q -p no:cacheprovider > "$OUT/t-tests.log" 2>&1 || true
        tail -n 1 "$OUT/t-tests.log"
        timeout 240 python3 benchmarks/backward.py run --grid full --plan "$TRANSPOSED_PLAN" --match d192 \
            --out "$OUT/t-ab.json" > "$OUT/t-ab.txt" 2>&1 || true
        python3 benchmarks/backward.py report "$OUT/t-ab.json" > "$OUT/t-ab.md" 2>&1 || true
        tail -n 16 "$OUT/t-ab.md"
    fi
    if [[ $parts == *,splits,* ]]; then
        python3 benchmarks/decode_splits.py --rule --out "$OUT/splits.json" > "$OUT/splits.txt" 2>&1 || true
        tail -n 12 "$OUT/splits.txt"
    fi
    if [[ $parts == *,splitcells,* ]]; then  # the split counts of decode_splits.py's CELLS (B 8 among them)
        python3 benchmarks/decode_splits.py --out "$OUT/splits-cells.json" > "$OUT/splits-cells.txt" 2>&1 || true
        tail -n 13 "$OUT/splits-cells.txt"
    fi
    if [[ $parts == *,importtime,* ]]; then  # where `import fa4gen` spends its time on this host
        python3 -c "import torch; p = torch.cuda.get_device_properties(0); \
print(p.name, 'memory clock kHz', p.memory_clock_rate, 'bus bits', p.memory_bus_width)" > "$OUT/device-props.txt" 2>&1 || true
        local i
        for i in 1 2 3; do python3 -X importtime -c "import torch, fa4gen" 2> "$OUT/importtime-$i.txt" || true; done
        grep -E "\| fa4gen$|\| tvm_ffi$" "$OUT/importtime-3.txt" || true
    fi
    if [[ $parts == *,firstcall,* ]]; then  # compiles on the GPU machine: needs .devfull (both calls)
        python3 benchmarks/first_call.py --variants a,b --repeat 3 --both-repeat 1 --import-repeat 7 \
            --time-limit "${FIRST_CALL_LIMIT:-450}" --out "$OUT/first-call.json" > "$OUT/first-call.txt" 2>&1 || true
        tail -n 30 "$OUT/first-call.txt"
    fi
    if [[ $parts == *,decode,* ]]; then
        python3 benchmarks/decode.py run --grid "${DECODE_GRID:-quick}" --match "${DECODE_MATCH:-}" \
            --part "${DECODE_PART:-1/1}" --out "$OUT/decode.json" > "$OUT/decode.txt" 2>&1 || true
        python3 benchmarks/decode.py report "$OUT/decode.json" | tail -n 8
    fi
    if [[ $parts == *,decodeab,* ]]; then
        local base="${DECODE_BASE:?DECODE_BASE: a folder holding a base tree fa4gen/, templates/ and kernels/}" i=0 side
        local cells=(--grid "${DECODE_GRID:-quick}" --match "${DECODE_MATCH:-}")
        for side in base new new base; do
            i=$((i + 1))
            if [ "$side" = base ]; then  # the base tree's fa4gen first on the path, with its own cache
                PYTHONPATH="$PWD/$base:$PYTHONPATH" FA4GEN_CACHE_DIR="$PWD/$base/kernels" python3 benchmarks/decode.py \
                    run "${cells[@]}" --out "$OUT/decodeab-$i-$side.json" > "$OUT/decodeab-$i-$side.txt" 2>&1 || true
            else
                python3 benchmarks/decode.py run "${cells[@]}" --out "$OUT/decodeab-$i-$side.json" \
                    > "$OUT/decodeab-$i-$side.txt" 2>&1 || true
            fi
        done
        python3 benchmarks/decode.py compare "$OUT"/decodeab-{1-base,2-new,3-new,4-base}.json > "$OUT/decodeab.md" || true
        tail -n 3 "$OUT/decodeab.md"
    fi
    if [[ $parts == *,schedule,* ]]; then
        python3 benchmarks/schedule_options.py run "${seqlens:?SEQLENS}" "${labels:?LABELS}" > "$OUT/schedule.txt" 2>&1
        tail -n 40 "$OUT/schedule.txt"
    fi
    if [[ $parts == *,ab,* ]]; then  # default against each label, both orders; AB_SPEC: a summary regex
        for label in ${labels//,/ }; do
            python3 -W ignore benchmarks/schedule_options.py ab "${seqlens:?SEQLENS}" "default,$label" "${AB_SPEC:-}" \
                > "$OUT/ab-$label-1.txt" 2>&1
            python3 -W ignore benchmarks/schedule_options.py ab "$seqlens" "$label,default" "${AB_SPEC:-}" \
                > "$OUT/ab-$label-2.txt" 2>&1
            python3 benchmarks/schedule_options.py combine "$OUT/ab-$label-1.txt" "$OUT/ab-$label-2.txt" | tail -n 3
        done
    fi
    if [[ $parts == *,profile,* ]]; then
        local cells cell
        IFS=';' read -ra cells <<< "${PROFILE:?PROFILE: ncu_counters.py arguments, cells separated by ;}"
        for cell in "${cells[@]}"; do
            # shellcheck disable=SC2086  # a cell is a list of arguments
            python3 benchmarks/ncu_counters.py $cell >> "$OUT/profile.txt" 2>&1 || true
        done
        grep -E "^=====|Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible" "$OUT/profile.txt" || true
    fi
    if [[ $parts == *,grid,* ]]; then
        python3 benchmarks/run.py run --grid full --part 1/2 --out "$OUT/grid-1.json" > "$OUT/grid-1.txt" 2>&1
        python3 benchmarks/run.py run --grid full --part 2/2 --out "$OUT/grid-2.json" > "$OUT/grid-2.txt" 2>&1
        python3 benchmarks/run.py report "$OUT/grid-1.json" "$OUT/grid-2.json" | tail -n 8
    fi
    if [[ $parts == *,variants,* ]]; then
        python3 benchmarks/variants.py run --out "$OUT/variants.json" > "$OUT/variants.txt" 2>&1
        tail -n 14 "$OUT/variants.txt"
    fi
}

case "${1:-}" in
    warm) shift; warm "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 warm [LABELS] | run PARTS [SEQLENS LABELS]" >&2; exit 2 ;;
esac
