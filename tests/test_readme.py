"""The README's two commands stay true: CI runs the test command verbatim; the main job's config exists. The README
stays short (at most 150 lines), its links resolve, and every figure it states has its source in docs/benchmarks.md."""

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
