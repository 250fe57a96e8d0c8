"""Folders of files an installed ajet writes or runs, kept in the checkout where the repository uses them and
installed as package data (setup.py's PACKAGE_DIRS): the main job (`tutorial/example_math_agent`, installed as
`ajet.init_templates.example_math_agent`, which `ajet init --kind math` writes) and the backbone venv builder
(`.ci`, installed as `ajet.backbone_env`, which `ajet backbone-env` runs).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ajet.errors import AjetError

#: package name -> its folder in a source checkout (relative to the repository root)
SHIPPED = {"ajet.init_templates.example_math_agent": "tutorial/example_math_agent", "ajet.backbone_env": ".ci"}


def shipped_folder(package: str) -> Path:
    """The folder of the data package `package` (a key of `SHIPPED`).

    From a wheel: the installed package's folder. From a source checkout whose editable install was made before
    the package was mapped (its import hook does not know the name): the checkout's folder.

    Raises:
        AjetError: neither exists (an installation without the package's files: reinstall ajet).
    """
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    checkout = Path(__file__).resolve().parent.parent / SHIPPED[package]
    if checkout.is_dir():
        return checkout
    raise AjetError(f"this ajet installation lacks the files of {package}: reinstall ajet (pip install ajet)")
