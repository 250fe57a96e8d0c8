#!/usr/bin/env bash
# The wheel as a user gets it: build it, install it (NOT editable) into a fresh venv, and from a folder outside
# the checkout run `ajet --version`, `ajet --help` (every command listed), `ajet harnesses`, `ajet init --kind math`
# (the main job's files), `ajet backbone-env verl --cache-path` (the shipped venv builder, reading the installed
# metadata), check the LICENSE in the installed .dist-info, one training step of a tiny config (the random 2-layer
# model of tests/tiny_model.py, the debug backbone), and `ajet backbone-env vllm`: the vLLM engine's venv made by the
# wheel's own script in the machine's venv cache (the key is the checkout's: seconds once .ci/make_vllm_env.sh, or
# .ci/run's vllm-env part beside this one, built it; a build under way is waited for), checked to import vLLM and
# to be what the installed vLLM engine finds (AJET_CI_VLLM_ENV=0, as for .ci/run, leaves it out). An editable
# install or the checkout on sys.path would hide a package or data file missing from the wheel, so the venv has no
# system site-packages, PYTHONPATH is unset, and the script fails if `ajet` or `ajet.backbones` is imported from the
# checkout.
#
# Installed both ways: first the client (`pip install ajet`: the wheel alone, no extra) in a venv of its own, which
# must import ajet.client without torch and refuse `ajet --conf` in one line naming ajet[train]; then the trainer
# (the wheel with its `train` extra), which runs the checks below.
# Dependencies come through uv (its cache makes a rerun take seconds). torch is the wheel that pip resolves for
# `torch==2.13.0` (the README's pin, through pip's own configuration: on a CPU machine that is the CPU wheel);
# a torch that requires nvidia-* CUDA packages is refused before anything is installed.
# Prints the seconds each part took. On the 2-core machine shared at load 13-15: 2 min 8 s with a warm uv cache,
# 3 min 5 s with a cold one (build 18 s, venv 36 s, training step 118 s, cleanup 12 s); 37 s of CPU in all. At load
# 8, 2026-12-06: 4 min 50 s, of which the vLLM venv's part 41 s with it cached (linking it 1 s; the rest is
# importing vLLM, and torch for the engine's lookup). The client install's part (a venv with the wheel and no extra,
# its checks) took 16 s at load 10 with uv's cache warm.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
t0=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
unset PYTHONPATH
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
step() { echo "[wheel_check $(( $(date +%s) - t0 )) s] $*"; }

# 1) the wheel, built (with build isolation, as `pip install .` builds it) from a copy of the build inputs, so
#    that no stale build/ folder of the checkout leaks into it
step "building the wheel"
mkdir "$work/src"
find . -maxdepth 1 -type f -exec cp {} "$work/src/" \;     # pyproject.toml, setup.py, README.md, ...
for folder in ajet tracker backbones tutorial/example_math_agent .ci; do   # setup.py's PACKAGE_DIRS
  mkdir -p "$work/src/$(dirname "$folder")"
  cp -r "$folder" "$work/src/$folder"
done
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
python3 -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(echo "$work"/dist/ajet-*.whl)

. .ci/uv_cpu_torch.sh   # ci_uv, ci_cpu_torch_wheel (a torch that requires nvidia-* packages is refused)
uv=$(ci_uv "$work")

# 2) the client install: the wheel without an extra (httpx, openai, pydantic, pyyaml), from a folder outside the
#    checkout: ajet.client and the workflow API import without torch, --version works, a trainer command says
#    what to install in one line (exit 2)
step "installing $(basename "$wheel") without extras (the client) into a fresh venv"
"$uv" venv -q --python "$(command -v python3)" "$work/client"
"$uv" pip install -q --python "$work/client/bin/python" "$wheel"
mkdir "$work/client-run"
(
  cd "$work/client-run"
  "$work/client/bin/python" -c "
import sys
import ajet, ajet.client
from ajet import Task, Workflow, WorkflowOutput
heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'starlette', 'uvicorn', 'rich'})
if heavy:
    sys.exit(f'wheel_check: importing ajet.client imported {heavy}')
print('client install: ajet.client imports without torch')"
  "$work/client/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" || {
    echo "wheel_check: the wheel without extras installed torch" >&2; exit 1; }
  [ "$("$work/client/bin/ajet" --version)" = "$(python3 -c "import tomllib; print('ajet', tomllib.load(open('$repo/pyproject.toml', 'rb'))['project']['version'])")" ] || {
    echo "wheel_check: the client install's ajet --version is wrong" >&2; exit 1; }
  rc=0; "$work/client/bin/ajet" --conf x.yaml > out.txt 2> err.txt || rc=$?
  want="ajet --conf needs the training dependencies: pip install 'ajet[train]'"
  [ "$rc" = 2 ] && [ "$(cat err.txt)" = "$want" ] && [ ! -s out.txt ] || {
    cat out.txt err.txt >&2; echo "wheel_check: the client's ajet --conf exited $rc, not 2 with: $want" >&2; exit 1; }
  echo "client install: $want (exit 2)"
)

# 3) the trainer install, in a fresh venv: torch first (pip picks the file, uv installs it), then the wheel with its
#    `train` extra and their dependencies
step "installing $(basename "$wheel")[train] into a fresh venv"
torch_wheel=$(ci_cpu_torch_wheel "$work/torch")
"$uv" venv -q --python "$(command -v python3)" "$work/venv"
"$uv" pip install -q --python "$work/venv/bin/python" "$torch_wheel" "ajet[train] @ file://$wheel"
if "$uv" pip list --python "$work/venv/bin/python" 2>/dev/null | grep -i '^nvidia-' | grep -vi '^nvidia-ml-py'; then
  echo "wheel_check: the venv pulled nvidia-* CUDA packages" >&2; exit 1
fi

# 4) the installed commands, from a folder outside the checkout
run="$work/run"
mkdir -p "$run"
cd "$run"
export PATH="$work/venv/bin:$PATH"
step "running the installed ajet from $run"
"$work/venv/bin/python" - "$repo" <<'EOF'
import sys
from pathlib import Path

import ajet, ajet.backbones, ajet.tracker

repo = Path(sys.argv[1]).resolve()
for module in (ajet, ajet.backbones, ajet.tracker):
    where = Path(module.__file__).resolve()
    print(f"{module.__name__}: {where}")
    if where.is_relative_to(repo):
        sys.exit(f"wheel_check: {module.__name__} was imported from the checkout ({where}), not from the wheel")
EOF
version=$(ajet --version)
want=$(python3 -c "import tomllib; print(tomllib.load(open('$repo/pyproject.toml', 'rb'))['project']['version'])")
[ "$version" = "ajet $want" ] || { echo "wheel_check: ajet --version printed '$version', not 'ajet $want'" >&2; exit 1; }
echo "$version"
help=$(ajet --help)
grep -q -- "--backbone" <<< "$help" || { echo "wheel_check: ajet --help lacks --backbone" >&2; exit 1; }
for command in serve gateway doctor eval view show sft export harnesses init backbone-env; do
  grep -q "^  ajet $command " <<< "$help" || { echo "wheel_check: ajet --help does not list $command" >&2; exit 1; }
done
"$work/venv/bin/python" - <<'EOF'
import sys
from importlib.metadata import distribution

files = [f for f in distribution("ajet").files if f.name == "LICENSE"]
if not files or "Apache License" not in files[0].read_text():
    sys.exit("wheel_check: the installed ajet has no Apache-2.0 LICENSE in its .dist-info")
print(f"license: {files[0]}")
EOF
ajet init main_job --kind math > init.txt
grep -q "ajet --conf math_agent.yaml" init.txt && [ -f main_job/math_agent.yaml ] && [ -f main_job/tasks/train.jsonl ] || {
  cat init.txt >&2; echo "wheel_check: ajet init --kind math did not write the main job" >&2; exit 1; }
cache=$(AJET_CI_VENV_CACHE="$work/venv-cache" ajet backbone-env verl --cache-path)
[[ "$cache" == "$work/venv-cache/verl-"* ]] || { echo "wheel_check: ajet backbone-env printed '$cache'" >&2; exit 1; }
echo "main job written by ajet init; backbone-env's cached venv would be $cache"
ajet harnesses | tee harnesses.txt
grep -q "^codex " harnesses.txt || { echo "wheel_check: ajet harnesses did not list the built-in registry" >&2; exit 1; }

# 5) one training step of the tiny random model (its builder and workflow are the tests' own, copied here)
step "one training step of the tiny model"
cp "$repo/tests/tiny_model.py" "$repo/tests/tiny_experiment.py" "$run/"
"$work/venv/bin/python" - <<'EOF'
import json
from tiny_experiment import WORKFLOW
from tiny_model import build_tiny_model

model = build_tiny_model("model")
open("wf.py", "w").write(WORKFLOW)
tasks = [{"task_id": f"t{i}", "query": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(2)]
open("tasks.jsonl", "w").write("".join(json.dumps(t) + "\n" for t in tasks))
open("conf.yaml", "w").write(f"""experiment_name: wheel_check
workflow: wf.py:ToolLoopWorkflow
model: {{path: "{model}", max_model_len: 1024}}
data: {{train_path: tasks.jsonl, shuffle: false}}
rollout: {{num_repeat: 2, max_tokens: 8, temperature: 1.0}}
algorithm: {{lr: 1.0e-3}}
trainer: {{total_steps: 1, tasks_per_step: 2}}
""")
EOF
timeout 600 ajet --conf conf.yaml --backbone=debug --exp-dir exp > train.log 2>&1 || {
  tail -n 40 train.log >&2; echo "wheel_check: the training step failed (log above)" >&2; exit 1; }
"$work/venv/bin/python" - <<'EOF'
import json, sys

steps = [json.loads(line) for line in open("exp/metrics.jsonl")]
trained = [s for s in steps if any(k.startswith("train/") for k in s)]
if not trained:
    sys.exit(f"wheel_check: exp/metrics.jsonl has no training step: {steps}")
print(f"trained {len(trained)} step(s); metrics keys: {len(trained[-1])}")
EOF

# 6) the vLLM engine's venv from the wheel (the machine's cache; .venvs/vllm here links it)
if [ "${AJET_CI_VLLM_ENV:-1}" != 0 ]; then
  step "ajet backbone-env vllm (the machine's venv cache)"
  ajet backbone-env vllm > vllm-env.txt 2>&1 || {
    tail -n 40 vllm-env.txt >&2; echo "wheel_check: ajet backbone-env vllm failed" >&2; exit 1; }
  tail -n 2 vllm-env.txt
  grep -q "/.venvs/vllm -> .* on disk) in " vllm-env.txt || {
    echo "wheel_check: ajet backbone-env vllm did not say where the venv is and its size" >&2; exit 1; }
  .venvs/vllm/bin/python -c "import vllm; print('vllm', vllm.__version__, 'imports')" 2>&1 | tail -n 1
  found=$("$work/venv/bin/python" -c "from ajet.engines.vllm_server import find_vllm_python; print(find_vllm_python())")
  [ "$(cd "$(dirname "$found")" && pwd -P)" = "$(cd .venvs/vllm/bin && pwd -P)" ] || {
    echo "wheel_check: the installed vLLM engine found '$found', not .venvs/vllm" >&2; exit 1; }
fi
step "passed (and the venv is removed now)"
