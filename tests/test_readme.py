"""The README's two commands stay true: CI runs the test command verbatim; the main job's config exists; the docs'
copies of both are the README's. The README stays short (at most 150 lines), its links resolve, and every figure it
states has its source in docs/benchmarks.md."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
    main_job, tests = _commands()
    assert "ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone=debug" in main_job
    assert tests.endswith("python -m pytest -q -n 3")
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()
    conf = main_job.split("--conf ")[1].split()[0]
    assert (ROOT / conf).is_file()


def test_both_readme_commands_install_the_trainer():
    """`pip install ajet` alone is the client (no torch): the main job's command installs the `train` extra, the
    test command the `test` extra, which includes it."""
    import tomllib

    main_job, tests = _commands()
    assert 'pip install -e ".[train]"' in main_job and 'pip install -e ".[test]"' in tests
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "ajet[train]" in project["optional-dependencies"]["test"]
    assert not any(d.startswith(("torch", "transformers")) for d in project["dependencies"]), project["dependencies"]


def test_the_docs_copies_of_the_two_commands_are_the_readmes():
    """docs/getting-started.md gives the test command as the README does and the main job's command in two blocks
    (install, then run) that join into the README's; any other install line in docs/ is one of the two or the start
    of one of them."""
    main_job, tests = _commands()
    install, run = main_job.rsplit(" && ", 1)
    blocks = re.findall(r"```bash\n(.+?)\n```", (ROOT / "docs" / "getting-started.md").read_text(), flags=re.S)
    assert tests in blocks, f"docs/getting-started.md's test command is not the README's: {tests}"
    assert install in blocks and run in blocks, f"docs/getting-started.md does not install and run as: {main_job}"
    differing = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```(?:bash|sh)\n(.+?)\n```", page.read_text(), flags=re.S):
            for line in block.splitlines():
                if line.startswith("pip install torch") and not any(
                        line == command or command.startswith(line + " && ") for command in (main_job, tests)):
                    differing.append(f"{page.name}: {line}")
    assert not differing, f"install commands in docs/ that differ from the README's two: {differing}"


README = ROOT / "README.md"


def _prose(text: str) -> str:
    """The README without its fenced code blocks."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_readme_is_at_most_150_lines():
    n = len(README.read_text().splitlines())
    assert n <= 150, f"README.md has {n} lines: move detail into docs/ and link to it"


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [x for x in links if "://" not in x]
    assert local, "the README links into docs/"
    missing = [x for x in local if not (ROOT / x).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_every_figure_in_the_readme_has_its_source_in_benchmarks():
    """A measured figure (a decimal, a percentage, a ratio like 1.24x, a duration) kept in the README must appear in
    docs/benchmarks.md, where its command, machine, load and date are given."""
    # versions (`torch==2.13.0`, Python 3.10) are not measurements
    prose = re.sub(r"(==|Python )\d+(\.\d+)+", "", _prose(README.read_text()))
    figures = re.findall(r"(?<![\w.])(\d+(?:[.,]\d+)?(?:%|x\b| ?(?:ms|min|s)\b)|\d+\.\d+)", prose)
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    unsourced = [f for f in figures if f not in benchmarks]
    assert not unsourced, f"figures in README.md without a source in docs/benchmarks.md: {unsourced}"
