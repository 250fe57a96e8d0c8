"""What keeps `.ci/run` short: a backbone venv built once per machine and copied into each checkout
(.ci/make_backbone_env.sh); the tests that use a backbone venv wait for one still being built
(tests/backbone_conformance/venvs.py); under pytest-xdist (the README's `pytest -n 3`) their files are handed out
first, in one process they run last (tests/ci_backbone_tests.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.backbone_conformance import venvs

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ".ci/make_backbone_env.sh"


def _checkout(dst: Path) -> Path:
    """A copy of what the script reads (its own file, the constraints, the build files, the package folders)."""
    (dst / ".ci").mkdir(parents=True)
    for f in (SCRIPT, ".ci/uv_cpu_torch.sh", ".ci/imports_from.py", ".ci/constraints-verl.txt", "pyproject.toml",
              "setup.py", "README.md"):
        shutil.copy2(ROOT / f, dst / f)
    for folder in ("ajet", "tracker", "backbones"):
        shutil.copytree(ROOT / folder, dst / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _cache_path(checkout: Path, env: dict) -> Path:
    out = subprocess.run(["bash", SCRIPT, "verl", "--cache-path"], cwd=checkout, env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return Path(out.strip())


def _shebang(script: Path) -> str:
    return script.read_text().splitlines()[0]


def test_a_cached_backbone_venv_is_copied_with_its_own_paths_and_this_checkouts_ajet(tmp_path):
    checkout = _checkout(tmp_path / "checkout")
    cache = tmp_path / "cache"
    env = {**os.environ, "AJET_CI_VENV_CACHE": str(cache)}
    base = _cache_path(checkout, env)
    assert base.parent == cache and base.name.startswith("verl-")

    # the key covers what decides the venv's contents, and only that
    pyproject = (checkout / "pyproject.toml").read_text()
    (checkout / "pyproject.toml").write_text(pyproject.replace('"pytest>=8",', '"pytest>=8.1",'))  # the test extra
    assert _cache_path(checkout, env) == base
    (checkout / "pyproject.toml").write_text(pyproject.replace('"peft>=0.15",', '"peft>=0.16",', 1))  # verl's
    assert _cache_path(checkout, env) != base
    (checkout / "pyproject.toml").write_text(pyproject)
    constraints = (checkout / ".ci/constraints-verl.txt").read_text()
    (checkout / ".ci/constraints-verl.txt").write_text(constraints + "six==1.17.0\n")
    assert _cache_path(checkout, env) != base
    (checkout / ".ci/constraints-verl.txt").write_text(constraints)
    assert _cache_path(checkout, env) == base

    # a cached venv (here: a bare one, no third-party packages) is copied, not rebuilt
    subprocess.run([sys.executable, "-m", "venv", str(base)], check=True, timeout=300)
    (base / ".complete").touch()
    probe = base / "lib" / "cached_file.txt"
    probe.write_text("from the cache")
    proc = subprocess.run(["bash", SCRIPT, "verl"], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "copied from the cached" in proc.stdout

    venv = checkout / ".venvs" / "verl"
    assert (venv / ".complete").exists() and not (checkout / ".venvs" / "verl.building").exists()
    assert os.path.samefile(venv / "lib" / "cached_file.txt", probe)          # hard links, not a copy
    assert _shebang(venv / "bin" / "pip").startswith(f"#!{venv}/bin/python")  # its own path, not the cache's
    assert _shebang(base / "bin" / "pip").startswith(f"#!{base}/bin/python")  # the cache left as it was
    where = "import ajet.backbones; print(ajet.backbones.__path__[0])"
    mine = subprocess.run([str(venv / "bin" / "python"), "-c", where], cwd="/", capture_output=True, text=True,
                          timeout=120)
    assert mine.stdout.strip() == str(checkout / "backbones"), mine.stderr      # ajet from THIS checkout
    cached = subprocess.run([str(base / "bin" / "python"), "-c", where], cwd="/", capture_output=True, text=True,
                            timeout=120)
    assert cached.returncode != 0                                              # the cache holds no ajet


def test_a_backbone_test_waits_for_its_venvs_build_and_not_for_a_dead_one(tmp_path, monkeypatch):
    venv = tmp_path / ".venvs" / "verl"
    venv.mkdir(parents=True)
    marker = tmp_path / ".venvs" / "verl.building"
    build = subprocess.Popen(["sh", "-c", f"sleep 2; touch '{venv}/.complete'; sleep 60"])
    monkeypatch.setattr(venvs, "ROOT", tmp_path)
    monkeypatch.setenv("CI", "true")                 # an absent venv fails, never skips
    monkeypatch.delenv("AJET_CI_BACKBONE_ENVS", raising=False)
    try:
        marker.write_text(str(build.pid))
        assert venvs.venv_python("verl") == str(venv / "bin" / "python")   # waited for the build to finish it
    finally:
        build.kill()
        build.wait()

    (venv / ".complete").unlink()
    marker.write_text(str(build.pid))               # a build that died: its marker stayed behind

    def no_waiting(_s):
        raise AssertionError("waited for a build whose process is gone")

    monkeypatch.setattr(venvs.time, "sleep", no_waiting)
    venvs.wait_for_build(venv)
    marker.unlink()
    venvs.wait_for_build(venv)                      # no build at all


def test_the_tests_that_use_a_backbone_venv_run_last():
    files = ["tests/test_backbone_main_job_trinity.py", "tests/test_backbone_conformance.py", "tests/test_readme.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert ids, proc.stdout + proc.stderr
    modules = [i.split("::")[0] for i in ids]
    first_backbone = modules.index("tests/test_backbone_main_job_trinity.py")
    assert set(modules[:first_backbone]) == {"tests/test_readme.py"}
    assert set(modules[first_backbone:]) == {"tests/test_backbone_main_job_trinity.py",
                                             "tests/test_backbone_conformance.py"}
    # in their own order, as given
    assert modules[first_backbone:] == sorted(modules[first_backbone:], key=files.index)


def _suite(tmp_path: Path) -> Path:
    """A suite with this repo's plugin and pytest options: a module that uses a backbone venv (it imports
    `venv_python`; its test does not call it), collected after two that do not."""
    tmp_path.mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --dist loadfile --no-loadscope-reorder\n")
    (tmp_path / "conftest.py").write_text(
        "from tests.ci_backbone_tests import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "test_a_core.py").write_text("def test_a1():\n    pass\n\ndef test_a2():\n    pass\n")
    (tmp_path / "test_b_core.py").write_text("def test_b():\n    pass\n")
    (tmp_path / "test_z_backbone.py").write_text(
        "from tests.backbone_conformance.venvs import venv_python\n\ndef test_in_a_backbone_venv():\n    pass\n")
    return tmp_path


def _ran(suite: Path, *args: str) -> list[str]:
    """The modules of the tests that passed, in the order they ran."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args], cwd=suite,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.split("::")[0].split()[-1] for line in proc.stdout.splitlines() if "PASSED" in line]


def test_backbone_files_run_first_on_xdist_workers_and_last_in_one_process(tmp_path):
    # one worker runs the units in the order they are handed out: the backbone file, then the rest as collected
    # (xdist's own default would hand out test_a_core.py first: it has the most tests)
    assert _ran(_suite(tmp_path / "xdist"), "-n", "1") == ["test_z_backbone.py", "test_a_core.py", "test_a_core.py",
                                                          "test_b_core.py"]
    assert _ran(_suite(tmp_path / "serial")) == ["test_a_core.py", "test_a_core.py", "test_b_core.py",
                                                 "test_z_backbone.py"]
