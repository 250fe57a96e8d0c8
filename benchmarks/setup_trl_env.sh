#!/usr/bin/env bash
# Make the optional environment benchmarks/vs_trl.py runs TRL's GRPOTrainer in: a virtual environment at
# .trl-venv (or $1) that sees the system's packages (the CPU torch, transformers) and adds TRL 1.16.0 and its
# own dependencies (datasets, pandas, pyarrow) without touching ajet's environment.
# torch is pinned to ajet's CPU 2.13.0 through a constraints file (as .ci/make_backbone_env.sh does), so that
# TRL runs on the very torch ajet is measured on; and no nvidia-* CUDA wheel may come in (checked before
# installing, on pip's plan, and after, on what is installed).
# Usage: bash benchmarks/setup_trl_env.sh [VENV_DIR]
set -euo pipefail
VENV="${1:-$(dirname "$0")/../.trl-venv}"
TORCH="torch==2.13.0"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" > "$constraints"

# nvidia-ml-py is NVML's Python binding (no CUDA); any other nvidia-* package means a CUDA build.
# The listing is read whole first: `pip ... | grep -q` would close the pipe at the first match, pip would die of
# SIGPIPE and, under pipefail, the pipeline would fail: the check would never fire.
cuda_packages() {   # stdin: pip's output; prints the nvidia-* CUDA package names found
    local listing
    listing="$(cat)"
    grep -oiE '(^|[[:space:]])nvidia-[A-Za-z0-9_.-]+' <<< "$listing" | sed -E 's/^[[:space:]]+//' \
        | grep -viE '^nvidia-ml-py' | sort -u || true
}

python -m venv --system-site-packages "$VENV"
plan="$("$VENV/bin/pip" install --dry-run -c "$constraints" trl==1.16.0 2>&1)" || {
    echo "$plan" >&2; echo "refusing: pip cannot install trl==1.16.0 with $TORCH" >&2; exit 1; }
found="$(cuda_packages <<< "$plan")"
if [ -n "$found" ]; then
    echo "refusing: installing trl would pull CUDA packages: $(echo $found)" >&2
    exit 1
fi
"$VENV/bin/pip" install -c "$constraints" trl==1.16.0
found="$("$VENV/bin/pip" list 2>/dev/null | cuda_packages)"
if [ -n "$found" ]; then
    echo "refusing: the TRL env holds CUDA packages: $(echo $found)" >&2
    exit 1
fi
"$VENV/bin/python" -c "import trl, torch; print('trl', trl.__version__, 'torch', torch.__version__)"
