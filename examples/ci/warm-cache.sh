#!/usr/bin/env bash
# CI job step (no GPU needed): compile every spec of the repo into a cache and ship it as one
# archive. A GPU machine then imports it and never compiles:
#
#   fa4gen cache import --sha256 HEX fa4gen-cache.tar.gz   # HEX: the digest this script prints
#   export FA4GEN_NO_COMPILE=1                   # a miss is an error naming the spec, not a compile
#
# An archive is code (each kernel.so in it is loaded and run): publish it, and its digest, only
# where the GPU machines' owners trust; the hashes inside it catch corruption, not malice.
#
# Usage: examples/ci/warm-cache.sh SPEC_DIR OUT_ARCHIVE [ARCHES]
#   OUT_ARCHIVE  the archive to write (relative to the current directory; parents are created)
#   ARCHES       comma-separated targets [default: sm_90a]
# The cache is $FA4GEN_CACHE_DIR if set (kept), else a temporary directory removed on exit.
set -euo pipefail
usage="usage: warm-cache.sh SPEC_DIR OUT_ARCHIVE [ARCHES]"
spec_dir=${1:?$usage}
archive=${2:?$usage}
arches=${3:-sm_90a}
if [[ -z ${FA4GEN_CACHE_DIR:-} ]]; then
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    trap 'exit 130' INT TERM HUP  # through the EXIT trap
    export FA4GEN_CACHE_DIR=$scratch/fa4gen-cache
fi
mkdir -p "$(dirname "$archive")"
jobs=$(python3 -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')
fa4gen warm "$spec_dir" --arch "$arches" -j "$jobs"   # exits non-zero if any spec failed
# A second run must compile nothing: every key is already in the cache. (Its report is captured
# and printed, not tee'd to /dev/stderr, which would truncate a log that stderr is redirected to.)
second=$(fa4gen warm "$spec_dir" --arch "$arches" -j 1)
printf '%s\n' "$second"
if ! grep -q '^0 compiled, ' <<<"$second"; then
    echo "error: the second warm compiled again: cache keys are not stable" >&2
    exit 1
fi
fa4gen cache verify
fa4gen cache export "$archive"
echo "cache for $arches written to $archive"
echo "sha256 $(sha256sum "$archive" | cut -d' ' -f1)"
