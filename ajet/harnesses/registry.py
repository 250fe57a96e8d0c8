"""The harness registry: coding-agent CLIs as data, installed into a cache, run unmodified per episode.

A harness is a `HarnessSpec` (ajet/config/workflow.py): its package and pinned version, the executable, the command line
of one non-interactive task, the environment variables and files that point it at the episode's proxy endpoint,
the API it speaks and its timeout. The built-in ones are in `builtin.yaml` beside this file; a config adds or
overrides one under its `harnesses:` section with the same keys.

Installs go to `$AJET_HARNESS_CACHE` (default `~/.cache/ajet/harnesses`), one folder per name and version:
`npm install --prefix <folder> PACKAGE@VERSION` for `npm:` packages (executable in `node_modules/.bin`), a venv
with PACKAGE==VERSION for `pip:` packages (executable in `bin`). Nothing is written into the repo.

A pip package's venv is made by `uv` (https://github.com/astral-sh/uv) when it is installed (`pip install uv`;
the `test` extra has it): aider-chat and its ~230 packages installed in 5 s with uv and 45 s with pip on a 2-core
machine (where pip had once taken ~10 min under load). uv reads PyPI (or `UV_INDEX_URL`), not pip.conf: when uv
fails, the install is tried again with `python -m venv` and pip.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from ajet.config import HarnessSpec
from ajet.errors import ConfigError

BUILTIN_FILE = Path(__file__).with_name("builtin.yaml")
INSTALL_TIMEOUT_S = 900


class HarnessInstallError(RuntimeError):
    """A harness could not be installed (the message names the command and its output's tail)."""


@functools.lru_cache(maxsize=1)
def builtin_harnesses() -> dict[str, HarnessSpec]:
    """The built-in registry, {name: spec}, read from builtin.yaml."""
    data = yaml.safe_load(BUILTIN_FILE.read_text())
    return {name: HarnessSpec.model_validate(entry) for name, entry in data.items()}


def all_harnesses(extra: dict[str, HarnessSpec] | None = None) -> dict[str, HarnessSpec]:
    """The built-in harnesses plus (overriding by name) a config's own `harnesses:`."""
    return {**builtin_harnesses(), **dict(extra or {})}


def get_harness(name: str, extra: dict[str, HarnessSpec] | None = None) -> HarnessSpec:
    """The spec named `name`.

    Raises:
        ConfigError: no harness of that name (the message lists the known ones).
    """
    known = all_harnesses(extra)
    if name not in known:
        raise ConfigError(f"unknown harness {name!r}: known are {', '.join(sorted(known))}; define your own under "
                          "the config's `harnesses:` (keys: package, version, executable, api, argv, env, files)")
    return known[name]


def cache_root() -> Path:
    """Where harnesses are installed: `$AJET_HARNESS_CACHE` or `~/.cache/ajet/harnesses`."""
    return Path(os.environ.get("AJET_HARNESS_CACHE", Path.home() / ".cache" / "ajet" / "harnesses")).expanduser()


def install_dir(name: str, spec: HarnessSpec) -> Path | None:
    """The folder holding this name and version's install (None for a harness without a package)."""
    if spec.package is None:
        return None
    return cache_root() / f"{name}-{spec.version or 'latest'}"


def executable(name: str, spec: HarnessSpec) -> str | None:
    """The installed executable's absolute path, or None when it is not installed (a harness without a package
    is looked up on PATH)."""
    folder = install_dir(name, spec)
    if folder is None:
        return shutil.which(spec.executable)
    sub = "node_modules/.bin" if spec.package.startswith("npm:") else "bin"
    path = folder / sub / spec.executable
    return str(path) if path.exists() else None


def install(name: str, spec: HarnessSpec) -> str:
    """Install the harness into the cache if it is not there yet (a pip package with uv when there is one, see
    the module docstring); returns its executable's path.

    Raises:
        HarnessInstallError: npm (or node) is missing for an `npm:` package, the install command failed (no
            network, unknown version), or it installed no executable of the expected name.
    """
    found = executable(name, spec)
    if found:
        return found
    folder = install_dir(name, spec)
    if folder is None:
        raise HarnessInstallError(f"harness {name!r}: `{spec.executable}` is not on PATH and the entry names no "
                                  "package to install it from")
    kind, package = spec.package.split(":", 1)
    # npm installs into a side folder renamed at the end; a venv's scripts name their interpreter by absolute
    # path, so it is built in place (and removed if the install fails)
    tmp = folder.with_name(folder.name + ".partial") if kind == "npm" else folder
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if kind == "npm":
        if shutil.which("npm") is None or shutil.which("node") is None:
            raise HarnessInstallError(f"harness {name!r} needs node and npm (for {package}); install Node.js")
        spec_str = f"{package}@{spec.version}" if spec.version else package
        commands = [["npm", "install", "--no-audit", "--no-fund", "--prefix", str(tmp), spec_str]]
        _run_all(name, commands, tmp)
    else:
        spec_str = f"{package}=={spec.version}" if spec.version else package
        python = str(tmp / "bin" / "python")
        pip = [[sys.executable, "-m", "venv", str(tmp)], [python, "-m", "pip", "install", "-q", spec_str]]
        uv = _uv()
        if uv is None:
            _run_all(name, pip, tmp)
        else:
            try:
                _run_all(name, [[uv, "venv", "--quiet", "--seed", "--python", sys.executable, str(tmp)],
                                [uv, "pip", "install", "--quiet", "--python", python, spec_str]], tmp)
            except HarnessInstallError as uv_failed:
                try:
                    _run_all(name, pip, tmp)
                except HarnessInstallError as exc:
                    raise HarnessInstallError(f"{uv_failed}\nand then without uv: {exc}") from exc
    if tmp != folder:
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    found = executable(name, spec)
    if not found:
        raise HarnessInstallError(f"harness {name!r}: installing {spec_str} made no `{spec.executable}` executable "
                                  f"in {folder}")
    return found


def _uv() -> str | None:
    """The `uv` executable: the `uv` package's own binary, else one on PATH; None when there is none."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def _run_all(name: str, commands: list[list[str]], folder: Path) -> None:
    """Run the install commands in order; on the first failure remove `folder` and raise HarnessInstallError
    (the message names the command and its stderr's tail)."""
    for argv in commands:
        try:
            subprocess.run(argv, check=True, capture_output=True, timeout=INSTALL_TIMEOUT_S)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            tail = (getattr(exc, "stderr", b"") or b"")[-600:].decode(errors="replace")
            shutil.rmtree(folder, ignore_errors=True)
            raise HarnessInstallError(f"harness {name!r}: `{' '.join(argv)}` failed: {exc}\n{tail}") from exc


def render(text: str, values: dict[str, str]) -> str:
    """`text` with each `{key}` of `values` replaced (other braces, e.g. JSON's, are left alone)."""
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


def listing(extra: dict[str, HarnessSpec] | None = None) -> list[dict[str, str]]:
    """One row per harness for `ajet harnesses`: name, package, version, api, installed (path or "no"), needs."""
    rows = []
    for name, spec in sorted(all_harnesses(extra).items()):
        rows.append({"name": name, "package": spec.package or "(on PATH)", "version": spec.version or "-",
                     "api": spec.api, "installed": executable(name, spec) or "no", "needs": spec.needs})
    return rows
