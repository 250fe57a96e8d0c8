"""Changes to a third-party module applied right after it is imported, wherever it is imported from.

The scale-out backbones change a few verl and Trinity functions on CPU (backbones/verl/cpu.py,
backbones/trinity/cpu.py). Some of those modules cannot be imported at the moment the change is installed (verl
imports ajet's module while `verl` itself is still being imported), and importing them costs seconds of CPU in a
process that never uses them (a Ray cluster's idle workers, the trinity backbone's explorer handle). So the change
waits for the module: a `sys.meta_path` finder wraps the module's loader, and once the module's code has run, the
change runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

Patches = dict[str, Callable[[ModuleType], None]]   # module name -> the change to make to it once it is executed


class PatchOnImport(importlib.abc.MetaPathFinder):
    """A finder that runs `patches[name](module)` right after module `name` is executed (imported for the first time
    in this process). It finds no module itself: the other finders find it, and it wraps the loader they return."""

    def __init__(self, patches: Patches) -> None:
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec                 # not installed, or a namespace package: nothing runs to patch
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            self.patches[fullname](module)

        spec.loader.exec_module = exec_and_patch
        return spec


def patch_on_import(patches: Patches) -> None:
    """From now on, `patches[name](module)` runs right after module `name` is imported in this process. Installing
    the same `patches` twice installs it once. A module imported before this call is not changed (the caller
    changes it, if it must)."""
    if not any(isinstance(f, PatchOnImport) and f.patches is patches for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport(patches))
