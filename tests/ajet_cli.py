"""Run the real `ajet` command on a config dict for one training step (for tests that train from a YAML)."""

import shutil
import subprocess
import sys
from pathlib import Path

import yaml


def train_one_step(conf: dict, tmp_path: Path, timeout_s: float = 170) -> tuple[subprocess.CompletedProcess, Path]:
    """Write `conf` to tmp_path/conf.yaml, run `ajet --conf ... --backbone=debug --steps 1` in tmp_path, assert
    it exited 0 (showing the output tails if not). Returns (the finished process, the experiment folder)."""
    (tmp_path / "conf.yaml").write_text(yaml.safe_dump(conf))
    exp = tmp_path / "exp"
    ajet = [shutil.which("ajet")] if shutil.which("ajet") else [sys.executable, "-m", "ajet"]
    proc = subprocess.run(ajet + ["--conf", str(tmp_path / "conf.yaml"), "--backbone=debug", "--steps", "1",
                                  "--exp-dir", str(exp)], capture_output=True, text=True, timeout=timeout_s,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, exp
