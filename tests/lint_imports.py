"""`lint-imports` (import-linter) on the import package `ajet` as it is installed: the contracts of pyproject.toml's
[tool.importlinter] checked against ajet/, with tracker/ as ajet.tracker and backbones/ as ajet.backbones.

import-linter reads a package from its folder, and the checkout's folders are not the package's (setup.py's
PACKAGE_DIRS maps them, and an editable install maps them at import time only), so this assembles the package's
Python files in a temporary folder, laid out as installed, and checks that. Exit status: import-linter's (0 when
every contract is kept). Run by .ci/run (its `lint` part) and tests/test_lint.py:

    python tests/lint_imports.py                 # assemble in a temporary folder and check
    python tests/lint_imports.py --tree DIR      # check a package `assemble(DIR)` wrote
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, str]:
    """setup.py's PACKAGE_DIRS (import name -> source folder), read without running setup.py; only the folders
    that hold Python packages of `ajet` (the data folders it also maps hold no imports to check)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    found = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "PACKAGE_DIRS" for t in node.targets))
    dirs = ast.literal_eval(found)
    return {name: folder for name, folder in dirs.items() if (ROOT / folder / "__init__.py").is_file()}


def assemble(into: Path) -> Path:
    """Copy every .py file of the package into `into`, laid out as installed; returns `into`."""
    for name, folder in sorted(package_dirs().items()):      # `ajet` first, then the folders mapped below it
        target = into.joinpath(*name.split("."))
        for src in (ROOT / folder).rglob("*.py"):
            dest = target / src.relative_to(ROOT / folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
    return into


def check(tree: Path) -> int:
    """Run import-linter's contracts on the package assembled in `tree`; returns its exit status (0: all kept)."""
    from importlinter.cli import lint_imports

    os.chdir(tree)   # lint-imports puts the working folder first on sys.path: `ajet` is found there
    return lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)


def main(argv: list[str]) -> int:
    """`python tests/lint_imports.py [--tree DIR]`: assemble the package in a temporary folder (or check DIR, one
    `assemble` wrote) and run the contracts; returns import-linter's exit status."""
    if argv[:1] == ["--tree"]:
        return check(Path(argv[1]))
    with tempfile.TemporaryDirectory(prefix="ajet-lint-imports-") as tmp:
        return check(assemble(Path(tmp)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
