#!/usr/bin/env bash
# Build the separate virtual environment of one scale-out backbone, for the CPU conformance tests.
#
#   .ci/make_backbone_env.sh verl     -> .venvs/verl     (ajet[verl]:    verl 0.9.1, transformers <5.11)
#   .ci/make_backbone_env.sh trinity  -> .venvs/trinity  (ajet[trinity]: trinity-rft 0.6.0, verl 0.8.0, numpy 1)
#
# verl 0.9 and Trinity 0.6 cannot share one environment (pip: ResolutionImpossible), and neither can share
# the core one (their transformers/numpy pins), hence one venv each. torch is pinned to the CPU 2.13.0 wheel
# through a constraints file so that no dependency pulls a CUDA torch (or nvidia-* wheels).
# Prints the seconds it took; tests/test_backbone_conformance.py skips (with the reason) when the venv is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:?usage: .ci/make_backbone_env.sh verl|trinity}"
case "$name" in verl|trinity) ;; *) echo "unknown backbone env: $name" >&2; exit 2;; esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
t0=$(date +%s)
venv=".venvs/$name"
rm -rf "$venv"
python3 -m venv "$venv"
constraints="$(mktemp)"
echo "torch==2.13.0" > "$constraints"
# one resolver run for everything (torch first, then the extra, makes pip backtrack through old datasets/fsspec)
"$venv/bin/pip" install -c "$constraints" torch==2.13.0 -e ".[$name]"
if "$venv/bin/pip" list 2>/dev/null | grep -qi '^nvidia-'; then
    echo "the $name env pulled nvidia-* packages (a CUDA torch?): refusing" >&2; exit 1
fi
touch "$venv/.complete"   # the tests use only a venv whose build finished
rm -f "$constraints"
echo "built $venv in $(( $(date +%s) - t0 )) s"
