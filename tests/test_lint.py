"""The lint CI runs (.ci/run's `lint` part), under the README's test command too: the import layers of
pyproject.toml's [tool.importlinter] hold (tests/lint_imports.py), and so do the docstring sections (ruff's
pydocstyle rules of [tool.ruff.lint]). Each check is shown to fail on a planted fault: an upward import inside a
function, a `Raises:` section run on from the one before."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = ROOT / "tests" / "lint_imports.py"
PACKAGES = ["ajet", "backbones", "tracker"]


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_import_layers_hold():
    r = _run(str(LINT_IMPORTS))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 broken" in r.stdout and "Layers: commands above the trainer" in r.stdout


def test_an_upward_import_inside_a_function_breaks_the_layers(tmp_path):
    spec = importlib.util.spec_from_file_location("lint_imports", LINT_IMPORTS)
    lint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lint)
    tree = lint.assemble(tmp_path / "pkg")
    with open(tree / "ajet" / "engines" / "base.py", "a") as f:   # the engine protocol reaching up to the trainer
        f.write("\n\ndef _planted():\n    from ajet.trainer import run\n\n    return run\n")
    r = _run(str(LINT_IMPORTS), "--tree", str(tree))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "BROKEN" in r.stdout and "ajet.engines.base -> ajet.trainer" in r.stdout, r.stdout[-3000:]


def test_the_docstring_sections_are_well_formed(tmp_path):
    r = _run("-m", "ruff", "check", "--no-cache", *PACKAGES)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    planted = tmp_path / "planted.py"
    planted.write_text(textwrap.dedent('''
        def f(x):
            """Double x.

            Args:
                x: a number.
            Raises:
                TypeError: x is no number.
            """
            return 2 * x
    '''))
    r = _run("-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(planted))
    assert r.returncode == 1 and "D411" in r.stdout and 'Missing blank line before section ("Raises")' in r.stdout, \
        r.stdout
