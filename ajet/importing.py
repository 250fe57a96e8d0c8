"""Loading the user's workflow class or judge function from `module:Name` or `path/to/file.py:Name`."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from ajet.errors import WorkflowLoadError


def load_object(spec: str, base_dir: Path | None = None) -> Any:
    """The object `Name` from `module:Name` or `file.py:Name`.

    Relative file paths are tried against `base_dir` (the config's folder) first, then the cwd. A file is
    imported under a unique module name registered in `sys.modules` (so pickling and dataclasses work).

    Raises:
        WorkflowLoadError: malformed spec, missing file/module (or a module's missing dependency), or no
            such attribute. Any other error raised while importing the user's file propagates unchanged
            (its traceback is what the user needs).
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise WorkflowLoadError(f"{spec!r} is not of the form `module:Name` or `path/to/file.py:Name`")
    if target.endswith(".py"):
        module = _load_file(target, base_dir)
    else:
        module = _import_module(target, spec, base_dir)
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise WorkflowLoadError(f"{target} has no attribute {name!r}; it defines: {', '.join(public)}") from None


def _import_module(target: str, spec: str, base_dir: Path | None) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and target != exc.name and not target.startswith(exc.name + "."):
            # the module exists but one of its own imports is missing
            raise WorkflowLoadError(f"importing {target!r} for {spec!r} failed: {exc} (is a dependency of "
                                    f"your workflow not installed?)") from exc
        as_file = target.replace(".", "/") + ".py"
        hint = next((f" A file {as_file} exists: write `{as_file}:{spec.rpartition(':')[2]}`."
                     for d in (base_dir, Path.cwd()) if d is not None and (d / as_file).is_file()), "")
        raise WorkflowLoadError(f"no module named {target!r} (from {spec!r}); expected `module:Name` for an "
                                f"importable module or `path/to/file.py:Name`.{hint}") from exc


def _load_file(target: str, base_dir: Path | None) -> Any:
    candidates = [Path(target)] if Path(target).is_absolute() else \
        [p for p in ((base_dir / target) if base_dir else None, Path.cwd() / target) if p is not None]
    path = next((p.resolve() for p in candidates if p.is_file()), None)
    if path is None:
        raise WorkflowLoadError(f"file not found: {target} (looked in {', '.join(str(c) for c in candidates)}); "
                                f"relative paths are resolved against the config file's folder, then the cwd")
    mod_name = f"ajet_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    sys.path.insert(0, str(path.parent))  # let the file import its siblings
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[mod_name]
        raise
    return module
