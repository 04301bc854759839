#!/usr/bin/env bash
# CI job step (no GPU needed): compile every spec of the repo into a cache and ship it as one
# archive. A GPU machine then imports it and never compiles:
#
#   fa4gen cache import fa4gen-cache.tar.gz      # verified entry by entry on import
#   export FA4GEN_NO_COMPILE=1                   # a miss is an error naming the spec, not a compile
#
# Usage: examples/ci/warm-cache.sh SPEC_DIR [OUT_ARCHIVE] [ARCHES]
set -euo pipefail
spec_dir=${1:?usage: warm-cache.sh SPEC_DIR [OUT_ARCHIVE] [ARCHES]}
archive=${2:-fa4gen-cache.tar.gz}
arches=${3:-sm_90a}
export FA4GEN_CACHE_DIR=${FA4GEN_CACHE_DIR:-$(mktemp -d)/fa4gen-cache}
jobs=$(python3 -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')
fa4gen warm "$spec_dir" --arch "$arches" -j "$jobs"   # exits non-zero if any spec failed
# a second run must compile nothing: every key is already in the cache
fa4gen warm "$spec_dir" --arch "$arches" -j 1 | tee /dev/stderr | grep '^0 compiled, ' >/dev/null
fa4gen cache verify
fa4gen cache export "$archive"
echo "cache for $arches written to $archive"
