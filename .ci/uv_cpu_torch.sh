# Sourced by the CI scripts that build a venv with uv (.ci/wheel_check.sh, .ci/make_backbone_env.sh):
#
#   ci_uv WORK               prints the uv to use: the one on PATH, else one pip installs into WORK/uv (seconds)
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
    python3 -m pip install -q --target "$work/uv" uv >&2 || return 1
    echo "$work/uv/bin/uv"
  fi
}

ci_cpu_torch_wheel() {
  local dir="$1" wheel requires
  python3 -m pip download -q --no-deps torch==2.13.0 -d "$dir" >&2 || return 1
  wheel=$(echo "$dir"/torch-2.13.0*.whl)
  [ -f "$wheel" ] || { echo "${0##*/}: pip downloaded no torch 2.13.0 wheel into $dir" >&2; return 1; }
  requires=$(python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1])
print(z.read(next(n for n in z.namelist() if n.endswith('.dist-info/METADATA'))).decode())" "$wheel")
  if grep -qi '^Requires-Dist: nvidia-' <<< "$requires"; then
    echo "${0##*/}: $(basename "$wheel") is a CUDA build (it requires nvidia-* packages): give pip a CPU" \
         "torch 2.13.0 (e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)" >&2
    return 1
  fi
  echo "$wheel"
}
