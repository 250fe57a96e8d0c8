"""The package list of the `ajet` distribution, computed (everything else is in pyproject.toml).

Three source folders make one import package: `ajet/` is `ajet`, `tracker/` is installed as `ajet.tracker` and
`backbones/` as `ajet.backbones`; two more folders ship files an installed ajet needs (`tutorial/example_math_agent`
as `ajet.init_templates.example_math_agent`, `.ci` as `ajet.backbone_env`). setuptools' declarative discovery (`[tool.setuptools.packages.find]`) finds
packages by their folder names only: it would install `tracker/` as a top-level `tracker` and cannot put it
under `ajet`. So the list is computed here: every package below each folder (a folder with an `__init__.py`),
named under the folder's import name. A new subpackage is picked up without an edit, and
tests/test_packaging.py checks the built wheel against the folders on disk.
"""

import os

from setuptools import find_packages, setup

# import name -> source folder (relative to this file)
PACKAGE_DIRS = {"ajet": "ajet", "ajet.tracker": "tracker", "ajet.backbones": "backbones",
                # files an installed ajet writes or runs, kept where the checkout uses them (one copy): the main
                # job (`ajet init --kind math`) and the backbone venv builder (`ajet backbone-env`); their
                # package data is listed in pyproject.toml
                "ajet.init_templates.example_math_agent": "tutorial/example_math_agent",
                "ajet.backbone_env": ".ci"}


def package_dirs() -> dict[str, str]:
    """PACKAGE_DIRS without the data folders absent here (a partial copy of the checkout, such as the one a backbone
    venv installs ajet from: tests/test_packaging.py and .ci/wheel_check.sh check the real wheel has them)."""
    return {name: folder for name, folder in PACKAGE_DIRS.items() if os.path.isdir(folder)}


def packages() -> list[str]:
    """Every import package of the distribution, e.g. `ajet.proxy.api`, `ajet.backbones.debug`."""
    found = []
    for name, folder in package_dirs().items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return sorted(found)


setup(packages=packages(), package_dir=package_dirs())
