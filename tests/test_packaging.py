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


# ---- the venv builders (`ajet backbone-env verl|trinity|verl-vllm|vllm`) from the wheel, outside any checkout ----

BUILDERS = ("make_backbone_env.sh", "make_vllm_env.sh", "uv_cpu_torch.sh", "imports_from.py",
            "constraints-verl.txt", "constraints-trinity.txt", "constraints-verl-vllm.txt", "overrides-verl-vllm.txt")


def _uv() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


def _site_packages(venv: Path) -> Path:
    (site,) = venv.glob("lib/python3*/site-packages")
    return site


def test_imports_from_compares_the_places_with_their_symlinks_resolved(tmp_path):
    """The check that ends a backbone venv's build: a package reached through a symlinked site-packages is inside
    the folder named by its resolved path, and the other way round; one from elsewhere is not."""
    real = tmp_path / "real" / "site-packages"
    (real / "pkg").mkdir(parents=True)
    (real / "pkg" / "__init__.py").write_text("")
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    linked = tmp_path / "linked" / "site-packages"
    (tmp_path / "elsewhere").mkdir()
    check = str(ROOT / ".ci" / "imports_from.py")

    def imports_from(path_entry: Path, folder: Path) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(path_entry)}
        return subprocess.run([sys.executable, check, "pkg", str(folder)], env=env, capture_output=True,
                              text=True, timeout=60, cwd=tmp_path / "elsewhere")

    assert imports_from(linked, real).returncode == 0         # imported through the link, the folder resolved
    assert imports_from(real, linked).returncode == 0         # and the other way round
    assert imports_from(linked, linked / "pkg").returncode == 0
    other = imports_from(linked, tmp_path / "elsewhere")
    assert other.returncode == 1 and f"not from inside {tmp_path / 'elsewhere'}" in other.stderr, other.stderr


def test_backbone_env_runs_from_the_installed_wheel_with_the_machines_cache(wheel, tmp_path, monkeypatch):
    """The wheel installed (not editable) into a fresh venv without system site-packages, reached through a
    symlink: `ajet backbone-env vllm` and `verl`, run from a folder outside the checkout, find the shipped scripts,
    key the cache as the checkout's scripts do, and take a complete cache entry in seconds (stand-ins: a bare venv
    with the `.complete` stamp). The verl venv's import check passes for the linked install; the vLLM engine of the
    wheel finds the cached vLLM venv from any folder."""
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"ajet/backbone_env/{f}" for f in BUILDERS} <= names, sorted(n for n in names if "backbone_env" in n)

    uv = _uv()
    real = tmp_path / "real"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(real / "venv")], check=True, timeout=120)
    (tmp_path / "home").symlink_to(real)                      # the venv (its site-packages) behind a symlink
    venv = tmp_path / "home" / "venv"
    # ajet with no dependencies but `packaging` (the backbone script reads the metadata with it): enough for
    # this command, which imports nothing else
    proc = subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--no-deps",
                           str(wheel), "packaging"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run, cache = tmp_path / "run", tmp_path / "cache"
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "AJET_PYTHON")}
    env.update(AJET_CI_VENV_CACHE=str(cache), PATH=f"{venv / 'bin'}:{Path(uv).parent}:{env['PATH']}")

    def ajet(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "ajet"), "backbone-env", *args], cwd=run, env=env,
                              capture_output=True, text=True, timeout=300)

    def cache_entry(name: str) -> Path:
        proc = ajet(name, "--cache-path")
        assert proc.returncode == 0, proc.stderr
        base = Path(proc.stdout.strip())
        # the checkout's script (same file, run by this python) names the same entry: one cache per machine
        args = [] if name == "vllm" else [name]
        script = ROOT / ".ci" / ("make_vllm_env.sh" if name == "vllm" else "make_backbone_env.sh")
        mine = subprocess.run(["bash", str(script), *args, "--cache-path"], env={**env, "PATH": os.environ["PATH"]},
                              capture_output=True, text=True, timeout=120, check=True)
        assert base == Path(mine.stdout.strip()) and base.parent == cache and base.name.startswith(f"{name}-")
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(base)], check=True, timeout=120)
        (base / ".complete").touch()
        return base

    # vLLM: .venvs/vllm links the cached venv (a stand-in whose python has a `vllm` package)
    vllm_base = cache_entry("vllm")
    (_site_packages(vllm_base) / "vllm").mkdir()
    (_site_packages(vllm_base) / "vllm" / "__init__.py").write_text("")
    proc = ajet("vllm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"reused the cached {vllm_base}" in proc.stdout and " on disk) in " in proc.stdout, proc.stdout
    link = run / ".venvs" / "vllm"
    assert link.is_symlink() and link.resolve() == vllm_base.resolve()

    # verl: a hard-linked copy of the cached venv with the installed ajet linked in, checked to import it
    verl_base = cache_entry("verl")
    proc = ajet("verl")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"copied from the cached {verl_base}" in proc.stdout, proc.stdout
    copy = run / ".venvs" / "verl"
    assert (copy / ".complete").exists() and f"train with it: {copy / 'bin' / 'ajet'}" in proc.stdout
    where = subprocess.run([str(copy / "bin" / "python"), "-c", "import ajet.backbones; print(ajet.__file__)"],
                           cwd="/", capture_output=True, text=True, timeout=120, env=env)
    assert Path(where.stdout.strip()).resolve() == _site_packages(real / "venv") / "ajet" / "__init__.py", where
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    shown = subprocess.run([str(copy / "bin" / "ajet"), "--version"], cwd="/", capture_output=True, text=True,
                           timeout=120, env=env)
    assert shown.stdout.strip() == f"ajet {version}", shown.stdout + shown.stderr     # with its metadata

    # the wheel's vLLM engine, started in a folder without .venvs, finds the machine's cached vLLM venv
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("AJET_CI_VENV_CACHE", str(cache))
    monkeypatch.delenv("AJET_VLLM_PYTHON", raising=False)
    proc = _run_from_extracted_wheel(site, "from ajet.engines.vllm_server import find_vllm_python; "
                                           "print(find_vllm_python())", cwd=tmp_path / "elsewhere")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(vllm_base / "bin" / "python")


# ---- the client install: `pip install ajet` (no extra) is ajet.client without torch; the trainer is ajet[train] ----

# packages of the trainer that a client install must not pull (a few gigabytes with torch's)
TRAINER_ONLY = ("torch", "transformers", "safetensors", "starlette", "uvicorn", "tensorboard", "matplotlib", "peft")
NEEDS_TRAIN = "needs the training dependencies: pip install 'ajet[train]'"


def test_the_wheel_without_extras_is_a_client_without_torch(wheel, tmp_path):
    """The wheel installed with its dependencies and no extra into a fresh venv (no system site-packages): the
    client API imports and no trainer package is there; `ajet --help`/`--version` work; a trainer command, config
    or not, stops in one line naming ajet[train] (exit 2); a command that reaches a trainer package later
    (`harnesses --install`: rich) says the same."""
    uv = _uv()
    venv = tmp_path / "client"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    proc = subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "AJET_PYTHON")}

    code = f"""
import importlib.util, json, sys
import ajet, ajet.client
from ajet import Task, Workflow, WorkflowOutput
from ajet.client import AjetClient, AsyncAjetClient
print(json.dumps({{"file": ajet.__file__, "imported": sorted({{m.split(".")[0] for m in sys.modules}}),
                  "installed": [m for m in {TRAINER_ONLY!r} if importlib.util.find_spec(m) is not None]}}))
"""
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=run, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).is_relative_to(venv), out["file"]          # the wheel's, not the checkout's
    assert out["installed"] == [], f"the client install pulled trainer packages: {out['installed']}"
    assert not set(TRAINER_ONLY) & set(out["imported"]), out["imported"]
    assert {"httpx", "ajet"} <= set(out["imported"])

    def ajet(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "ajet"), *args], cwd=run, env=env, capture_output=True, text=True,
                              timeout=120)

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert ajet("--version").stdout.strip() == f"ajet {version}"
    shown = ajet("--help")
    assert shown.returncode == 0 and "ajet serve " in shown.stdout, shown.stderr
    (run / "conf.yaml").write_text("workflow: wf.py:W\ndata: {train_path: tasks.jsonl}\n")
    for args, prog in ((["--conf", "x.yaml"], "ajet --conf"), (["--conf", "conf.yaml", "--steps", "1"], "ajet --conf"),
                       (["serve", "--conf", "conf.yaml"], "ajet serve"), (["eval", "--conf", "conf.yaml"], "ajet eval")):
        proc = ajet(*args)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"{prog} {NEEDS_TRAIN}\n"), (args, proc)
    proc = ajet("harnesses", "--install", "aider")
    assert (proc.returncode, proc.stderr) == (2, f"ajet harnesses {NEEDS_TRAIN} (not installed: rich)\n"), proc
    assert not (run / "experiments").exists()
