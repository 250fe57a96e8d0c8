"""The package list of the `ajet` distribution, computed (everything else is in pyproject.toml).

Three source folders make one import package: `ajet/` is `ajet`, `tracker/` is installed as `ajet.tracker` and
`backbones/` as `ajet.backbones`. setuptools' declarative discovery (`[tool.setuptools.packages.find]`) finds
packages by their folder names only: it would install `tracker/` as a top-level `tracker` and cannot put it
under `ajet`. So the list is computed here: every package below each folder (a folder with an `__init__.py`),
named under the folder's import name. A new subpackage is picked up without an edit, and
tests/test_packaging.py checks the built wheel against the folders on disk.
"""

from setuptools import find_packages, setup

# import name -> source folder (relative to this file)
PACKAGE_DIRS = {"ajet": "ajet", "ajet.tracker": "tracker", "ajet.backbones": "backbones"}


def packages() -> list[str]:
    """Every import package of the distribution, e.g. `ajet.proxy.api`, `ajet.backbones.debug`."""
    found = []
    for name, folder in PACKAGE_DIRS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return sorted(found)


setup(packages=packages(), package_dir=PACKAGE_DIRS)
