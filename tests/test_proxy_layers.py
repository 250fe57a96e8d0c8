"""The proxy's modules import downwards only: no import circle among `ajet.proxy.*` (issue 24 item 16).

Every `import` / `from ... import` of each module is read with `ast`, those under `if TYPE_CHECKING:` and
inside functions included (a circle hidden from the interpreter is still a circle for a reader), and the
graph is searched for a cycle. Expected: the server imports its adapters, the adapters never the server.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ajet.proxy

ROOT = Path(ajet.proxy.__file__).parent


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """The `ajet.proxy` modules `path` imports (a `from package import name` of a submodule counts as it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("ajet.proxy")}


def test_no_import_circle_in_the_proxy():
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph = {m: {i for i in _imports(p, m) if i in modules and i != m} for m, p in modules.items()}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import circles: {cycles}"
    assert "ajet.proxy.api" in graph["ajet.proxy.server"] and "ajet.proxy.server" not in graph["ajet.proxy.api"]
