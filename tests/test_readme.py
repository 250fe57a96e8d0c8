"""The README's two commands stay true: CI runs the test command verbatim; the main job's config exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
    main_job, tests = _commands()
    assert "ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone=debug" in main_job
    assert tests.endswith("python -m pytest -q")
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()
    conf = main_job.split("--conf ")[1].split()[0]
    assert (ROOT / conf).is_file()
