"""Lower modules never import higher ones: no import cycle among ajet's modules.

An AST walk of every module of the `ajet` distribution (the folders setup.py's PACKAGE_DIRS maps: `ajet/`,
`tracker/` as `ajet.tracker`, `backbones/` as `ajet.backbones`), nothing imported, so it also covers the
backbones whose packages (verl, Trinity) are not installed here. Every import counts, wherever it is:
at the top, under `if TYPE_CHECKING:`, or inside a function (a lazy import is still a dependency). The
implicit import of a module's parent package does not (else every package `__init__` would close a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ajet_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages setup.py maps (its PACKAGE_DIRS)."""
    setup_py = ast.parse((ROOT / "setup.py").read_text())
    dirs = next(ast.literal_eval(n.value) for n in setup_py.body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PACKAGE_DIRS")
    mods = {}
    for package, folder in dirs.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            mods[".".join((package, *parts))] = f
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The ajet modules that module `name` (file `path`) imports anywhere in its body."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                    # relative: from the package, up level - 1
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from mod import name`, the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:                       # `import ajet.tracker.sample.x` -> the module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle (a -> b -> ... -> a) per strongly connected component of more than one module
    (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(_a_cycle(v, component, graph))
    return found


def _a_cycle(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside `component` (breadth-first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def test_the_cycle_finder_finds_a_planted_cycle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({**graph, "c": {"d"}}) == []


def test_no_module_of_ajet_imports_one_that_imports_it_back():
    mods = ajet_modules()
    assert {"ajet.workflow", "ajet.tools.mcp_hub", "ajet.tracker.sample", "ajet.backbones.verl.backbone"} <= set(mods)
    graph = {name: imports_of(name, path, mods) for name, path in mods.items()}
    assert "ajet.tool_types" in graph["ajet.workflow"]           # the walk sees TYPE_CHECKING imports
    found = cycles(graph)
    assert not found, "import cycles (a lower module imports a higher one):\n" + "\n".join(
        " -> ".join(c) for c in found)
