"""benchmarks/setup_trl_env.sh refuses a CUDA torch and pins ajet's CPU torch (issue 24, item 14).

Its guard never fired: under `set -o pipefail`, `pip ... | grep -q nvidia-` closed the pipe at the first
match, pip died of SIGPIPE, the pipeline failed and the install went on (torch 2.14.1+cu130 and 15 nvidia-*
packages, a 5.7 GB venv). The script runs here for real, against a stand-in `python` / `pip` on PATH (no
network): the stand-in pip prints what pip would, with a long tail after the nvidia line so a pipe closed
early would SIGPIPE it.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "setup_trl_env.sh"

FAKE_PYTHON = r"""#!/usr/bin/env bash
# stand-in for `python -m venv --system-site-packages DIR`: DIR/bin/pip and DIR/bin/python
[ "$1 $2" = "-m venv" ] || { echo "unexpected python call: $*" >&2; exit 2; }
dir="${@: -1}"
mkdir -p "$dir/bin"
cp "$FAKE_BIN/pip.in" "$dir/bin/pip"
printf '#!/usr/bin/env bash\necho "trl 1.16.0 torch 2.13.0"\n' > "$dir/bin/python"
chmod +x "$dir/bin/pip" "$dir/bin/python"
"""

FAKE_PIP = r"""#!/usr/bin/env bash
# stand-in pip: logs each call (and the constraints file it was given), answers like pip
echo "pip $*" >> "$FAKE_LOG"
args=("$@")
for i in "${!args[@]}"; do
    if [ "${args[$i]}" = "-c" ]; then echo "constraints: $(cat "${args[$((i + 1))]}")" >> "$FAKE_LOG"; fi
done
case "$1" in
  install)
    if [ "$2" = "--dry-run" ]; then
        echo "Collecting trl==1.16.0"
        echo "Would install accelerate-1.10.0 datasets-4.0.0 $FAKE_PLAN trl-1.16.0"
        for i in $(seq 1 20000); do echo "  filler line $i of a long resolver log"; done
    fi ;;
  list)
    printf 'Package Version\ntrl 1.16.0\ntorch 2.13.0\n%s\n' "$FAKE_INSTALLED" ;;
esac
"""


def run_script(tmp_path: Path, plan: str = "", installed: str = "") -> tuple[subprocess.CompletedProcess, str]:
    """Run the script with the stand-ins; `plan` is added to pip's "Would install" line, `installed` to
    `pip list`. Returns the run and the stand-in pip's log."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(FAKE_PYTHON)
    (fake / "pip.in").write_text(FAKE_PIP)
    for f in fake.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "pip.log"
    log.touch()
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "FAKE_BIN": str(fake), "FAKE_LOG": str(log),
           "FAKE_PLAN": plan, "FAKE_INSTALLED": installed}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "venv")], env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, log.read_text()


def test_a_plan_with_a_cuda_torch_is_refused_before_anything_is_installed(tmp_path):
    proc, log = run_script(tmp_path, plan="nvidia-cublas-cu12-12.8.4.1 nvidia-ml-py-13.0.0 torch-2.14.1")
    assert proc.returncode == 1, proc.stdout[-500:] + proc.stderr[-500:]
    assert "refusing: installing trl would pull CUDA packages: nvidia-cublas-cu12-12.8.4.1" in proc.stderr
    assert "nvidia-ml-py" not in proc.stderr.split("CUDA packages:")[1]       # NVML's binding is no CUDA
    assert [line for line in log.splitlines() if line.startswith("pip install")] == [
        line for line in log.splitlines() if line.startswith("pip install --dry-run")]   # no real install


def test_torch_is_pinned_by_a_constraints_file_and_a_clean_plan_installs(tmp_path):
    proc, log = run_script(tmp_path, plan="nvidia-ml-py-13.0.0")
    assert proc.returncode == 0, proc.stderr[-1000:]
    installs = [line for line in log.splitlines() if line.startswith("pip install")]
    assert len(installs) == 2 and installs[1].startswith("pip install -c ") and installs[1].endswith("trl==1.16.0")
    assert log.count("constraints: torch==2.13.0") == 2              # the dry run and the install
    assert "trl 1.16.0 torch 2.13.0" in proc.stdout


def test_cuda_packages_found_after_the_install_are_refused(tmp_path):
    proc, _ = run_script(tmp_path, installed="nvidia-cudnn-cu12 9.10.2.21\nnvidia-ml-py 13.0.0")
    assert proc.returncode == 1 and "the TRL env holds CUDA packages: nvidia-cudnn-cu12" in proc.stderr, proc.stderr
