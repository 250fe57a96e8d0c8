#!/usr/bin/env bash
# Make the optional environment benchmarks/vs_trl.py runs TRL's GRPOTrainer in: a virtual environment at
# .trl-venv (or $1) that sees the system's packages (the CPU torch, transformers) and adds TRL 1.16.0 and its
# own dependencies (datasets, pandas, pyarrow) without touching ajet's environment.
# Usage: bash benchmarks/setup_trl_env.sh [VENV_DIR]
set -euo pipefail
VENV="${1:-$(dirname "$0")/../.trl-venv}"
python -m venv --system-site-packages "$VENV"
# a CUDA torch must never be pulled in on a CPU machine: refuse if the resolver wants any nvidia- package
if "$VENV/bin/pip" install --dry-run trl==1.16.0 2>&1 | grep -q "nvidia-"; then
    echo "refusing: installing trl would pull nvidia-* packages (a CUDA torch)" >&2
    exit 1
fi
"$VENV/bin/pip" install trl==1.16.0
"$VENV/bin/python" -c "import trl, torch; print('trl', trl.__version__, 'torch', torch.__version__)"
