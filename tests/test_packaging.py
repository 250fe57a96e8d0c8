"""The wheel holds every package and every file the code reads at run time, and works without the checkout.

The expected contents come from the folders on disk, never from pyproject.toml or setup.py: ajet/ installs as
`ajet`, tracker/ as `ajet.tracker`, backbones/ as `ajet.backbones` (README's layout), and every file below them
(code, the viewer's page, the harness registry's builtin.yaml, any data file added later) must be in the wheel.
A file that should not ship does not belong in these folders.

The wheel is built from a copy of the source (`pip wheel --no-deps --no-build-isolation`: no venv, no network, ~3 s)
so that the build's own folders never land in the shared checkout. .ci/wheel_check.sh installs the same wheel into
a fresh venv and trains a step with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> its place in the installed `ajet` package
SOURCE_FOLDERS = {"ajet": "ajet", "tracker": "ajet/tracker", "backbones": "ajet/backbones"}


def _is_build_debris(path: Path) -> bool:
    return "__pycache__" in path.parts or path.suffix in {".pyc", ".pyo"}


def expected_wheel_files() -> set[str]:
    """Every file below the source folders, as its path inside the wheel (e.g. `ajet/ajet/engines/in_process.py`)."""
    out = set()
    for folder, installed in SOURCE_FOLDERS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and not _is_build_debris(path.relative_to(ROOT)):
                out.add(f"{installed}/{path.relative_to(ROOT / folder).as_posix()}")
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's build inputs (top-level files and the source folders)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for item in ROOT.iterdir():
        if item.is_file():   # pyproject.toml, setup.py, README.md (the long description), ...
            shutil.copy2(item, src / item.name)
    # and the two folders setup.py installs as package data (the main job, the backbone venv builder)
    for folder in (*SOURCE_FOLDERS, "tutorial/example_math_agent", ".ci"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (tmp / "dist").glob("ajet-*.whl")
    return built


def test_the_wheel_holds_every_package_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = expected_wheel_files()
    assert {"ajet/algorithm/loss.py", "ajet/harnesses/builtin.yaml", "ajet/viewer/static/index.html",
            "ajet/tracker/context_tracker.py", "ajet/backbones/debug/backbone.py"} <= expected   # the walk works
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {len(missing)} file(s) of the source folders: {missing[:20]}"
    # nothing outside the `ajet` package (no top-level `tracker`, `backbones` or `tests`)
    stray = sorted(n for n in names if not n.startswith(("ajet/", "ajet-")))
    assert not stray, stray
    dist_info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "ajet = ajet.cli:_entry" in zipfile.ZipFile(wheel).read(dist_info).decode()


def _run_from_extracted_wheel(site: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run `code` with the extracted wheel first on sys.path and the checkout unreachable.

    `python -S` skips the site-packages' .pth files, among them the editable install's import hook, which
    would quietly serve any module missing from the wheel out of the checkout; the dependencies' folders are
    then put back on sys.path by hand (after the wheel)."""
    deps = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    prelude = f"import sys; sys.path[:] = [{str(site)!r}] + sys.path + {deps!r}\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-S", "-c", prelude + code], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def test_every_module_of_the_wheel_imports_without_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = r"""
import importlib, json, pkgutil
import ajet, ajet.backbones, ajet.tracker
where = {m.__name__: m.__file__ for m in (ajet, ajet.backbones, ajet.tracker)}
failed = {}
for info in pkgutil.walk_packages(ajet.__path__, "ajet.", onerror=lambda name: failed.setdefault(name, "walk")):
    if info.name.endswith(".__main__"):   # runs the CLI
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "ajet":   # an optional dependency (verl, trinity) may be absent
            failed[info.name] = str(exc)
from ajet.viewer.app import STATIC_DIR
from ajet.harnesses.registry import BUILTIN_FILE
print(json.dumps({"where": where, "failed": failed, "static": str(STATIC_DIR), "builtin": str(BUILTIN_FILE)}))
"""
    proc = _run_from_extracted_wheel(site, code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for module, file in out["where"].items():
        assert Path(file).is_relative_to(site), f"{module} was imported from {file}, not from the wheel"
    assert out["failed"] == {}, out["failed"]
    assert (Path(out["static"]) / "index.html").is_file() and Path(out["builtin"]).is_file()


def test_cli_from_the_wheel_prints_its_version_and_harnesses(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    proc = _run_from_extracted_wheel(site, "from ajet.cli import main; main(['--version'])", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"ajet {version}", proc.stdout + proc.stderr
    proc = _run_from_extracted_wheel(site, "import sys; from ajet.cli import main; sys.exit(main(['harnesses']))",
                                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = {line.split()[0] for line in proc.stdout.splitlines()[1:] if line.strip()}
    assert {"codex", "claude-code", "mini-swe-agent", "aider"} <= listed, proc.stdout
