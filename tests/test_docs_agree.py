"""The docs agree with themselves: the main job has one current table of figures (earlier runs below it, dated), a
share of the 160 held-out problems reads the same wherever it is stated, nothing points at figures the README no
longer holds, and the CHANGELOG has a section for what is not released yet. Read from the files; nothing runs."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
# what a user reads: the docs site, the README, the tutorials' READMEs and configs
PROSE = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "tutorial").rglob("*.md")])
CONFIGS = sorted((ROOT / "tutorial").rglob("*.yaml"))
HELD_OUT = 160  # tutorial/example_math_agent/tasks/test.jsonl, the main job's test set


def _section(text: str, heading: str) -> str:
    """The body under `heading` (a whole line, e.g. "### Current figures") up to the next heading of its level or
    above."""
    level = len(heading) - len(heading.lstrip("#"))
    assert f"\n{heading}\n" in text, f"no '{heading}' heading"
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    end = re.search(rf"^#{{1,{level}}} ", text[start:], flags=re.M)
    return text[start:start + end.start()] if end else text[start:]


def _tables(text: str) -> list[list[str]]:
    """The Markdown tables in `text`, each as its body rows (the lines after the `|---|` separator)."""
    tables, rows, in_table = [], [], False
    for line in text.splitlines() + [""]:
        if re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", line):
            in_table, rows = True, []
        elif in_table and line.startswith("|"):
            rows.append(line)
        elif in_table:
            tables.append(rows)
            in_table = False
    return tables


def _share(count: int) -> str:
    """count/160 as a percentage with one decimal, a tie to the even digit (the rule docs/benchmarks.md states)."""
    return str((Decimal(count) * 100 / HELD_OUT).quantize(Decimal("0.1"), rounding=ROUND_HALF_EVEN))


def test_the_main_job_has_one_current_table_and_its_earlier_runs_below_it():
    main_job = _section(BENCHMARKS.read_text(), "## The main job")
    current = _section(main_job, "### Current figures")
    tables = _tables(current)
    assert len(tables) == 1, f"'The main job / Current figures' has {len(tables)} tables: keep one, the latest " \
                             "run of each seed, and move earlier runs to 'Earlier runs'"
    seeds = [re.match(r"\|\s*(\d+)", row).group(1) for row in tables[0]]
    assert seeds == [str(s) for s in range(10)], f"one row per seed 0-9, got {seeds}"
    undated = [row[:40] for row in tables[0] if not re.search(r"\| 20\d\d-\d\d-\d\d \|\s*$", row)]
    assert not undated, f"each current row ends with its date (YYYY-MM-DD): {undated}"
    assert main_job.index("### Current figures") < main_job.index("### Earlier runs"), \
        "earlier runs of the main job go below its current figures, under '### Earlier runs'"


def test_a_share_of_the_held_out_set_reads_the_same_everywhere():
    """`P% (N/160` states P = N/160 rounded as the benchmarks page says; a gain `A% -> B% (N/160, +G points)` is
    G = B - A, the difference of the shares as shown."""
    wrong = []
    for path in PROSE:
        text = re.sub(r"\*\*", "", path.read_text())
        for share, count in re.findall(rf"(\d+(?:\.\d)?)% \((\d+)/{HELD_OUT}\b", text):
            if share != _share(int(count)):
                wrong.append(f"{path.name}: {share}% for {count}/{HELD_OUT} (= {_share(int(count))}%)")
        for before, after, gain in re.findall(
                rf"(\d+\.\d)%(?: \(\d+/{HELD_OUT}\))? -> (\d+\.\d)% \(\d+/{HELD_OUT}, ([+-]\d+\.\d) points", text):
            expected = Decimal(after) - Decimal(before)
            if Decimal(gain) != expected:
                wrong.append(f"{path.name}: {before}% -> {after}% stated as {gain} points ({expected:+})")
    assert not wrong, "held-out shares stated inconsistently:\n" + "\n".join(wrong)


def test_the_checks_above_see_the_main_jobs_figures():
    """The patterns of the test above still match what the benchmarks page writes (they would pass on nothing)."""
    text = re.sub(r"\*\*", "", BENCHMARKS.read_text())
    assert len(re.findall(rf"\d+\.\d% \(\d+/{HELD_OUT}\b", text)) >= 10
    assert len(re.findall(rf"-> \d+\.\d% \(\d+/{HELD_OUT}, [+-]\d+\.\d points", text)) >= 10


def test_nothing_points_at_the_readmes_seeds():
    """The per-seed figures live in docs/benchmarks.md; the README only links there."""
    stale = [f"{path.relative_to(ROOT)}:{n}" for path in PROSE + CONFIGS
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"README'?s?\W+(?:\w+\W+)?seeds?\b", line)]
    assert not stale, f"these point at seeds in the README, which holds none (say docs/benchmarks.md): {stale}"


def test_the_changelog_has_an_unreleased_section_first():
    versions = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert versions and versions[0] == "Unreleased", f"CHANGELOG.md's first section is {versions[:1]}, not Unreleased"


def test_the_site_loads_the_stylesheet_that_fits_wide_tables():
    """Without docs/stylesheets/tables.css every table of the configuration reference scrolls at 1280 px with its
    description column cut off (measured in Chromium: 30 of 30 tables wider than the content column; with it, none)."""
    css = ROOT / "docs" / "stylesheets" / "tables.css"
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^extra_css:\n(?:  - .*\n)*  - stylesheets/tables\.css\b", mkdocs, flags=re.M), \
        "mkdocs.yml's extra_css does not load stylesheets/tables.css"
    assert re.search(r"table:not\(\[class\]\) th,[^{]*\{[^}]*min-width: 0", css.read_text()), \
        "tables.css no longer lifts the theme's minimum width of a header cell"
