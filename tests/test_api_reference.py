"""The API reference (docs/api.md, rendered from docstrings by mkdocstrings) covers the public surface, and every
public function, method and property it renders has a docstring, with a `Raises:` section wherever its own body
raises an exception (the constructor's in the class docstring). Read from the source with `ast`; nothing runs."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

API_PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
# the surface a user meets: a workflow and its tuner, the `ajet serve` client, the judges, the engine and
# backbone protocols, the task readers
SURFACE = ["ajet.workflow.Workflow", "ajet.workflow.Tuner", "ajet.workflow.WorkflowOutput", "ajet.task.Task",
           "ajet.client.AjetClient", "ajet.client.AsyncAjetClient", "ajet.client.EpisodeHandle",
           "ajet.judges.load_judge", "ajet.judges.math_answer.math_answer_judge",
           "ajet.judges.countdown.countdown_judge", "ajet.judges.frozenlake.frozenlake_judge",
           "ajet.judges.llm.LLMJudge", "ajet.engines.base.Engine", "ajet.backbones.base.Backbone",
           "ajet.tasks.load_tasks", "ajet.tasks.jsonl.read_jsonl_tasks",
           "ajet.tasks.hf.read_hf_tasks", "ajet.tasks.generator.read_generator_tasks",
           "ajet.tasks.env_service.read_env_service_tasks"]


def _entries() -> list[str]:
    return re.findall(r"^::: (\S+)\s*$", API_PAGE.read_text(), flags=re.M)


def _resolve(dotted: str):
    """The object a `:::` entry names."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _raises(func) -> bool:
    """Whether `func`'s own body (not a nested function's) has a `raise X` (a bare re-raise does not count)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    top = tree.body[0]
    stack = list(ast.iter_child_nodes(top))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def _members(obj):
    """(name, function, docstring that documents it) for what the page renders of `obj`: a function itself; a
    class's own public methods and properties, and its `__init__` (documented by the class docstring)."""
    if not inspect.isclass(obj):
        yield obj.__qualname__, obj, obj.__doc__ or ""
        return
    init = obj.__init__                  # its own or inherited (e.g. from a private base): the page shows it
    if _ours(init, "ajet"):
        yield f"{obj.__qualname__}()", init, (obj.__doc__ or "") + (init.__doc__ or "")
    for name, member in vars(obj).items():
        func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if name != "__init__" and (not name.startswith("_") or name == "__call__") and _ours(func, obj.__module__):
            yield f"{obj.__qualname__}.{name}", func, func.__doc__ or ""


def _ours(func, module: str) -> bool:
    """A function written in `module` (or a module under it), not one generated (a Protocol's or a dataclass's
    methods) or inherited from Python."""
    return (inspect.isfunction(func) and (func.__module__ or "").startswith(module)
            and func.__code__.co_filename[0] != "<")


def test_the_page_covers_the_public_surface():
    missing = sorted(set(SURFACE) - set(_entries()))
    assert not missing, f"docs/api.md has no `::: NAME` entry for {missing}"


def test_every_entry_is_a_name_a_user_can_import():
    """An entry is rendered under the name it is written with: `backbones.base.Backbone` (the source folder's name)
    cannot be imported from an installed ajet; `ajet.backbones.base.Backbone` can (docs/hooks/griffe_ajet.py
    gives the docs build that name, and the build's hook fails on a rendered name outside `ajet`)."""
    outside = [e for e in _entries() if not e.startswith("ajet.")]
    assert not outside, f"docs/api.md names objects outside the installed `ajet` package: {outside}"
    for entry in _entries():
        _resolve(entry)


@pytest.mark.parametrize("entry", _entries())
def test_every_rendered_docstring_is_there_and_names_what_it_raises(entry):
    obj = _resolve(entry)
    assert (obj.__doc__ or "").strip(), f"{entry}: no docstring"
    problems = []
    for name, func, doc in _members(obj):
        if not doc.strip():
            problems.append(f"{name}: no docstring")
        elif _raises(func) and "Raises:" not in doc:
            problems.append(f"{name}: raises, but its docstring has no `Raises:` section")
    assert not problems, f"{entry}:\n" + "\n".join(problems)
