"""Make repository tasks from working code: mutate a function, keep the tests that catch the mutation.

    python tutorial/example_swe_tasks/generate.py [--seeds DIR] [--out DIR] [--seed N]

Each seed is a module `NAME.py` (one documented function that works) and its tests `test_NAME.py` in --seeds.
For each one, every single-site mutation of the module's syntax tree is tried (a comparison flipped, `+` for
`-`, an integer constant off by one, ...), in order; a mutation qualifies when the module still imports and at
least one test fails. One qualifying mutation is chosen (`--seed` picks which), and the task is written:

    OUT/repos/NAME/NAME.py             the mutated module
    OUT/repos/NAME/tests/test_NAME.py  only the tests that fail on it (they pass on the original)
    OUT/repos/NAME/ISSUE.md            a one-paragraph issue: what the docstring promises and a failing test
    OUT/tasks.jsonl                    one row per task (query = the issue; repo; test_command; tests)

The fix is the seed itself (`seeds/NAME.py`): the tests in tests/test_harnesses.py play it back.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ajet.tasks.repo import DEFAULT_TEST_COMMAND as TEST_COMMAND

HERE = Path(__file__).parent

SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv,
         ast.Div: ast.Mult, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv, ast.And: ast.Or, ast.Or: ast.And}


def mutations(source: str) -> list[tuple[str, str]]:
    """Every single-site mutation of `source`: [(description, mutated source)], in syntax-tree order."""
    tree = ast.parse(source)
    sites = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sites += [(node, "ops", i) for i, op in enumerate(node.ops) if type(op) in SWAPS]
        elif isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)) and type(node.op) in SWAPS:
            sites.append((node, "op", None))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            sites += [(node, "const", +1), (node, "const", -1)]
    out = []
    for k, (_node, kind, arg) in enumerate(sites):
        mutated = copy.deepcopy(tree)
        target = [n for n in ast.walk(mutated)][[n for n in ast.walk(tree)].index(sites[k][0])]
        if kind == "ops":
            old = target.ops[arg]
            target.ops[arg] = SWAPS[type(old)]()
            what = f"{type(old).__name__} -> {type(target.ops[arg]).__name__} on line {target.lineno}"
        elif kind == "op":
            old = target.op
            target.op = SWAPS[type(old)]()
            what = f"{type(old).__name__} -> {type(target.op).__name__} on line {target.lineno}"
        else:
            what = f"constant {target.value} -> {target.value + arg} on line {target.lineno}"
            target.value += arg
        out.append((what, ast.unparse(mutated) + "\n"))
    return out


def failing_tests(module_name: str, module_src: str, test_src: str) -> tuple[list[str], dict[str, str]]:
    """Run the tests against `module_src` in a scratch folder: (failing test names, {name: failure line})."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / f"{module_name}.py").write_text(module_src)
        (Path(tmp) / "tests").mkdir()
        (Path(tmp) / "tests" / f"test_{module_name}.py").write_text(test_src)
        try:   # a mutation that loops forever is not a task
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"], cwd=tmp,
                               capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return [], {}
    failed, why = [], {}
    for line in p.stdout.splitlines():
        m = re.match(r"^(FAILED|ERROR) tests/\S+::(\w+)(?: - (.*))?", line)
        if m:
            failed.append(m.group(2))
            why[m.group(2)] = (m.group(3) or "").strip()
    if p.returncode not in (0, 1):   # a collection error: the mutated module does not import
        return [], {}
    return failed, why


def issue_text(func: str, module: str, doc: str, test: str, why: str) -> str:
    """The one-paragraph issue of a task."""
    return (f"`{func}` in `{module}.py` does not do what its docstring says (\"{doc.strip()}\"): the test "
            f"`tests/test_{module}.py::{test}` fails{(' with `' + why + '`') if why else ''}. Fix `{func}` so that "
            f"the tests in `tests/test_{module}.py` pass, without changing the tests.")


def make_task(seed_module: Path, out: Path, rng: random.Random) -> dict | None:
    """Write one task from a seed module and its tests; returns its tasks.jsonl row (None: no mutation is caught)."""
    name = seed_module.stem
    source = seed_module.read_text()
    test_src = (seed_module.parent / f"test_{name}.py").read_text()
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    candidates = mutations(source)
    rng.shuffle(candidates)
    for what, mutated in candidates:
        failed, why = failing_tests(name, mutated, test_src)
        if failed:
            break
    else:
        return None
    test_tree = ast.parse(test_src)
    keep = [n for n in test_tree.body if not isinstance(n, ast.FunctionDef) or n.name in failed]
    repo = out / "repos" / name
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "tests").mkdir(parents=True)
    (repo / f"{name}.py").write_text(mutated)
    (repo / "tests" / f"test_{name}.py").write_text(
        "\n\n".join(ast.get_source_segment(test_src, n) for n in keep) + "\n")
    issue = issue_text(fn.name, name, ast.get_docstring(fn) or "", failed[0], why.get(failed[0], ""))
    (repo / "ISSUE.md").write_text(issue + "\n")
    return {"task_id": name, "query": issue, "repo": f"repos/{name}", "test_command": TEST_COMMAND,
            "tests": [f"tests/test_{name}.py::{t}" for t in failed], "mutation": what}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=Path, default=HERE / "seeds", help="folder of NAME.py + test_NAME.py")
    ap.add_argument("--out", type=Path, default=HERE, help="where repos/ and tasks.jsonl go")
    ap.add_argument("--seed", type=int, default=0, help="shuffles the order mutations are tried in")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    for module in sorted(args.seeds.glob("*.py")):
        if module.name.startswith("test_"):
            continue
        row = make_task(module, args.out, rng)
        print(f"{module.stem}: " + (f"{row['mutation']}, {len(row['tests'])} failing test(s)" if row else
                                    "no mutation is caught by its tests: skipped"))
        if row:
            rows.append(row)
    (args.out / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} tasks -> {args.out / 'tasks.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
