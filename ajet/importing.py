"""Loading the user's workflow class, judge or task generator from `module:Name` or `path/to/file.py:Name`.

A module that fails while it is imported (a SyntaxError, a NameError at module level, a package that is not
installed) is said in one line naming the role, the file and line, and the exception:

    workflow wf.py:3: NameError: name 'foo' is not defined
    workflow wf.py:1: ModuleNotFoundError: No module named 'langchain_openai' (pip install 'ajet[langchain]')
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from ajet.errors import WorkflowLoadError


# the optional packages of ajet's extras (pyproject.toml's [project.optional-dependencies]), by top-level module;
# `train` is the trainer's (torch, transformers, the proxy's server, ...): `pip install ajet` alone is the client
EXTRAS = {"torch": "train", "transformers": "train", "accelerate": "train", "safetensors": "train",
          "tokenizers": "train", "gguf": "train", "starlette": "train", "uvicorn": "train", "aiohttp": "train",
          "orjson": "train", "jsonschema": "train", "rich": "train", "tensorboard": "train", "mcp": "train",
          "matplotlib": "train", "peft": "train",
          "agentscope": "agentscope", "langchain_openai": "langchain", "langgraph": "langchain",
          "langchain_core": "langchain", "langchain": "langchain", "ray": "ray", "wandb": "wandb",
          "datasets": "datasets", "reasoning_gym": "reasoning-gym"}


def load_object(spec: str, base_dir: Path | None = None, role: str = "workflow") -> Any:
    """The object `Name` from `module:Name` or `file.py:Name`.

    Relative file paths are tried against `base_dir` (the config's folder) first, then the cwd. A file is
    imported under a unique module name registered in `sys.modules` (so pickling and dataclasses work).
    `role` names what the object is for in the messages ("workflow", "judge", "task generator").

    Raises:
        WorkflowLoadError: malformed spec, missing file/module, no such attribute, or the module raised while
            it was imported (`import_failure`: one line with the role, file:line and the exception).
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise WorkflowLoadError(f"{spec!r} is not of the form `module:Name` or `path/to/file.py:Name`")
    if target.endswith(".py"):
        module = _load_file(target, base_dir, role)
    else:
        module = _import_module(target, spec, base_dir, role)
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise WorkflowLoadError(f"{target} has no attribute {name!r}; it defines: {', '.join(public)}") from None


def import_failure(role: str, exc: BaseException, target: str) -> str:
    """One line for an exception raised while importing a user's module: "<role> <file>:<line>: <Type>:
    <message>", the file and line being the SyntaxError's own, else the innermost frame of the traceback in a
    file that is neither ajet's nor an installed package's (the user's `import x` line when x is missing);
    a missing module of one of ajet's extras names the extra to install (`EXTRAS`). File paths under the
    current folder are written relative to it."""
    from ajet.failures import is_user_file

    where = None
    message = str(exc)
    if isinstance(exc, SyntaxError) and exc.filename:
        where = (exc.filename, exc.lineno)
        message = exc.msg or message
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
        if frames:
            where = (frames[-1].filename, frames[-1].lineno)
    line = f"{type(exc).__name__}: {message}"
    if isinstance(exc, ModuleNotFoundError) and exc.name:   # (its text may be "import of x halted; ...")
        missing = _missing_module(exc.name)
        line = f"ModuleNotFoundError: No module named {missing!r} ({missing_package_hint(missing)})"
    if where is None:
        return f"{role} {target}: {line}"
    return f"{role} {_shown_path(where[0])}:{where[1]}: {line}"


def missing_package_hint(module: str) -> str:
    """What to install for a missing `module` (a dotted name): the ajet extra that brings it (`pip install
    'ajet[langchain]'`), else where it is missing (the Python running ajet)."""
    top = module.split(".")[0]
    if top in EXTRAS:
        return f"pip install 'ajet[{EXTRAS[top]}]'"
    return f"not installed in the Python running ajet, {sys.executable}"


def _missing_module(name: str) -> str:
    """The module to name for a ModuleNotFoundError of `name`: its top-level package when that is not installed
    (`agentscope`, not `agentscope.agent`), else `name` itself."""
    top = name.split(".")[0]
    try:
        return top if importlib.util.find_spec(top) is None else name
    except (ImportError, ValueError):
        return name


def _shown_path(path: str) -> str:
    with contextlib.suppress(ValueError):
        if Path(path).resolve().is_relative_to(Path.cwd().resolve()):
            return os.path.relpath(path)
    return path


def _import_module(target: str, spec: str, base_dir: Path | None, role: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and target != exc.name and not target.startswith(exc.name + "."):
            # the module exists but one of its own imports is missing
            raise WorkflowLoadError(import_failure(role, exc, target)) from None
        as_file = target.replace(".", "/") + ".py"
        hint = next((f" A file {as_file} exists: write `{as_file}:{spec.rpartition(':')[2]}`."
                     for d in (base_dir, Path.cwd()) if d is not None and (d / as_file).is_file()), "")
        raise WorkflowLoadError(f"no module named {target!r} (from {spec!r}); expected `module:Name` for an "
                                f"importable module or `path/to/file.py:Name`.{hint}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing: said in one line
        raise WorkflowLoadError(import_failure(role, exc, target)) from None


def _load_file(target: str, base_dir: Path | None, role: str) -> Any:
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
    except Exception as exc:  # noqa: BLE001 - the user's file raised while importing: said in one line
        del sys.modules[mod_name]
        raise WorkflowLoadError(import_failure(role, exc, target)) from None
    return module
