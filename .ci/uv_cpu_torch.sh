# Sourced by the scripts that build a venv with uv (.ci/wheel_check.sh, .ci/make_backbone_env.sh,
# .ci/make_vllm_env.sh; the last two also ship in the wheel, where `ajet backbone-env` runs them):
#
#   ci_uv WORK               prints the uv to use: the one on PATH, else one pip installs into WORK/uv (seconds)
#   ci_pip WORK ARGS...      runs pip: that of $AJET_PYTHON (the python ajet is installed in) or of python3, else
#                            one uv installs into WORK/pip (a venv that uv made has no pip)
#   ci_cpu_torch_wheel DIR   downloads torch 2.13.0 into DIR and prints the wheel's path
#
# uv does not read pip's configuration, and PyPI's linux torch 2.13.0 is a CUDA build (it requires nvidia-*
# wheels, gigabytes). So pip picks the torch file (`pip download --no-deps torch==2.13.0`, through pip's own
# configuration: on a CPU machine that is the CPU wheel) and uv installs that file. A wheel whose METADATA requires
# nvidia-* packages is refused (exit 1) before anything is installed.

ci_uv() {
  local work="$1"
  if command -v uv > /dev/null; then
    command -v uv
  else   # .ci/run installs uv before it starts the builds; a script run on its own may find none
    ci_pip "$work" install -q --target "$work/uv" uv >&2 || return 1
    echo "$work/uv/bin/uv"
  fi
}

ci_pip() {
  local work="$1" py
  shift
  for py in "${AJET_PYTHON:-}" python3; do
    if [ -n "$py" ] && "$py" -m pip --version > /dev/null 2>&1; then
      "$py" -m pip "$@"; return
    fi
  done
  py="${AJET_PYTHON:-python3}"
  if command -v uv > /dev/null && uv pip install -q --python "$py" --target "$work/pip" pip >&2; then
    PYTHONPATH="$work/pip" "$py" -m pip "$@"; return
  fi
  echo "${0##*/}: no pip found (neither $py nor python3 has it, and no uv to fetch it): install pip" >&2
  return 1
}

ci_cpu_torch_wheel() {
  local dir="$1" wheel requires
  ci_pip "$dir" download -q --no-deps torch==2.13.0 -d "$dir" >&2 || return 1
  wheel=$(echo "$dir"/torch-2.13.0*.whl)
  [ -f "$wheel" ] || { echo "${0##*/}: pip downloaded no torch 2.13.0 wheel into $dir" >&2; return 1; }
  requires=$("${AJET_PYTHON:-python3}" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1])
print(z.read(next(n for n in z.namelist() if n.endswith('.dist-info/METADATA'))).decode())" "$wheel")
  if grep -qi '^Requires-Dist: nvidia-' <<< "$requires"; then
    echo "${0##*/}: $(basename "$wheel") is a CUDA build (it requires nvidia-* packages): give pip a CPU" \
         "torch 2.13.0 (e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)" >&2
    return 1
  fi
  echo "$wheel"
}
