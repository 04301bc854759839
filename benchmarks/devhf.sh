#!/usr/bin/env bash
# transformers on the lent H200, for tests/test_gpu_hf.py: that machine has Python 3.12, torch,
# numpy, pyyaml, typer and rich, but no network and no transformers. Two entry points:
#
#   bash benchmarks/devhf.sh prepare    # here (a machine with a package index): the cp312 manylinux
#                                       # wheels transformers needs beyond what the H200 has, into
#                                       # .devhf/wheels (~19 MiB, git-ignored), and .devhf/setup.sh
#   bash .devhf/setup.sh                # there (carry .devhf): installs them into /tmp/devhf-site
#                                       # (DEVHF_SITE), checks the import, prints the PYTHONPATH line;
#                                       # `source .devhf/setup.sh` exports it as well
#
# e.g. the GPU test, in a device call carrying .devrt, .devcache (the kernels of
# tests/hf_cases.py's hf_gpu_specs() among them) and .devhf:
#   set +u; source .devrt/setup.sh && source .devhf/setup.sh && chmod -R go-w .devcache &&
#   FA4GEN_CACHE_DIR=$PWD/.devcache/kernels FA4GEN_TOOLCHAIN=$(cat .devcache/toolchain) FA4GEN_NO_COMPILE=1 \
#       python3 -m pytest tests/test_gpu_hf.py -q -p no:cacheprovider
#
#   bash benchmarks/devhf.sh check PYTHON   # here: install .devhf/wheels into a throwaway target and
#                                           # import transformers with PYTHON (a Python 3.12 holding
#                                           # the H200's packages; the model modules too where it
#                                           # has torch), the environment otherwise empty
#
# The set is what `import transformers` and its model classes need at import time (no tokenizer is
# used, but transformers' auto classes import tokenizers): transformers' and huggingface_hub's
# requirements less what the H200 has (numpy, pyyaml, typer, rich, torch and torch's own
# requirements) and less hf-xet and click, which nothing imports on this path; filelock, fsspec
# and packaging are carried although torch or pytest may bring them (a few hundred KiB). Checked
# here with `check` on a Python 3.12 venv of numpy, pyyaml, typer and rich, and, the set with
# regex's cp311 wheel, by tests/test_hf.py in a Python 3.11 venv of torch and those packages only.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.devhf
PINS=(
    transformers==5.17.0
    huggingface-hub==1.33.0  # transformers 5.17: huggingface-hub>=1.5.0,<2.0
    tokenizers==0.23.3       # transformers 5.17: tokenizers>=0.23.1,<0.24.0
    safetensors==0.8.0       # transformers 5.17: safetensors>=0.8.0
    regex==2026.11.19        # transformers 5.17: regex>=2025.10.22
    tqdm==4.70.1
    packaging==26.4
    filelock==4.3.1
    fsspec==2026.9.0
    httpx==0.29.0            # huggingface_hub's HTTP client, imported by transformers.utils.hub
    httpcore==1.0.9
    h11==0.16.0
    anyio==4.16.0
    idna==3.20
    certifi==2026.10.19.post1
)

prepare() {
    local python=${PYTHON:-python3}
    rm -rf "$DIR" && mkdir -p "$DIR/wheels"
    "$python" -m pip download --quiet --only-binary=:all: --no-deps --implementation cp --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        --dest "$DIR/wheels" "${PINS[@]}"
    printf '%s\n' "${PINS[@]}" > "$DIR/requirements.txt"
    write_setup > "$DIR/setup.sh"
    chmod +x "$DIR/setup.sh"
    ls "$DIR/wheels"
    du -sh --apparent-size "$DIR"
}

write_setup() {
    cat <<'EOF'
#!/usr/bin/env bash
# Written by benchmarks/devhf.sh prepare: transformers for a machine without network or transformers.
#   bash .devhf/setup.sh      install .devhf/wheels into $DEVHF_SITE (/tmp/devhf-site) once per machine,
#                             check the import, print the line that puts it on PYTHONPATH
#   source .devhf/setup.sh    the same, and export PYTHONPATH in this shell
_devhf_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_devhf_site=${DEVHF_SITE:-/tmp/devhf-site}
if [ ! -f "$_devhf_site/.devhf-ok" ]; then
    rm -rf "$_devhf_site"
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --find-links "$_devhf_dir/wheels" --target "$_devhf_site" -r "$_devhf_dir/requirements.txt" \
        && touch "$_devhf_site/.devhf-ok" \
        || { echo "devhf: pip install into $_devhf_site failed" >&2; return 1 2>/dev/null || exit 1; }
fi
PYTHONPATH="$_devhf_site${PYTHONPATH:+:$PYTHONPATH}" python3 -c "
import transformers, transformers.masking_utils, transformers.cache_utils
from transformers.models.gemma2 import modeling_gemma2
print('transformers', transformers.__version__, 'from', transformers.__path__[0])
" || { echo "devhf: import transformers failed" >&2; return 1 2>/dev/null || exit 1; }
echo "export PYTHONPATH=$_devhf_site\${PYTHONPATH:+:\$PYTHONPATH}"
export PYTHONPATH="$_devhf_site${PYTHONPATH:+:$PYTHONPATH}"
EOF
}

check() {
    local python=${1:?"PYTHON: a Python 3.12 holding the packages of the H200"}
    CHECK_SITE=$(mktemp -d)
    trap 'rm -rf "$CHECK_SITE"' EXIT
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
        --find-links "$DIR/wheels" --target "$CHECK_SITE" -r "$DIR/requirements.txt"
    env -i PATH=/usr/bin:/bin HOME="$CHECK_SITE" PYTHONPATH="$CHECK_SITE" "$python" -c "
import ast, importlib, transformers
from transformers import AutoConfig
AutoConfig.for_model('gemma2', sliding_window=5)
try:
    import torch  # noqa: F401
except ImportError:
    print('transformers', transformers.__version__, 'and its configs import (no torch here: models not checked)')
else:
    import transformers.masking_utils, transformers.cache_utils
    tree = ast.parse(open('tests/hf_cases.py').read())
    modules = next(ast.literal_eval(n.value) for n in tree.body
                   if isinstance(n, ast.Assign) and [getattr(t, 'id', '') for t in n.targets] == ['MODULES'])
    for package, name in modules.values():
        getattr(importlib.import_module(f'transformers.models.{package}.modeling_{package}'), name)
    print('transformers', transformers.__version__, 'and the model modules of tests/hf_cases.py import')
"
}

case "${1:-}" in
    prepare) prepare ;;
    check) shift; check "$@" ;;
    *) echo "usage: $0 prepare | check PYTHON" >&2; exit 2 ;;
esac
