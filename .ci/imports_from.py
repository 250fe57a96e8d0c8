"""Whether a python imports a package from inside a folder: the check that ends a backbone venv's build
(.ci/make_backbone_env.sh: the venv must run the ajet it was built for, not another copy).

    <python> imports_from.py PACKAGE FOLDER     exit 0: PACKAGE's folder is inside FOLDER; 1 (and why) if not

Both sides are compared with their symlinks resolved: the venv reaches ajet through a link (its `.ajet-src/ajet`,
or an editable install's mapping), and a site-packages may itself lie behind one (a venv under a linked home or
cache folder, `lib64 -> lib`), while the folder the build was given may be written either way.
"""

import importlib
import os
import sys


def main(package: str, folder: str) -> int:
    """Exit status: 0 if `package` imports from a place inside `folder` (symlinks resolved), else 1 (printed why)."""
    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        print(f"{package} does not import: {exc}", file=sys.stderr)
        return 1
    where = os.path.realpath(next(iter(module.__path__)) if hasattr(module, "__path__") else module.__file__)
    root = os.path.realpath(folder)
    if os.path.commonpath([where, root]) != root:
        print(f"{package} imports from {where}, not from inside {root}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
