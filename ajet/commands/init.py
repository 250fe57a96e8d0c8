"""`ajet init [DIR] --kind chat|command|harness|mcp|math`: write a small project that trains as written.

    ajet init my_agent --kind chat      # my_agent/ajet.yaml, workflow.py, tasks/train.jsonl, tasks/val.jsonl

Each kind is a real project, not a stub (the templates are in ajet/init_templates/): a config for the bundled
SmolLM2-135M-Instruct, the code of one episode, a few tasks and a reward; `math` writes the main job itself
(tutorial/example_math_agent, installed with ajet). A folder that already holds anything is
refused unless `--force` (then only the template's own files are written over; nothing else is touched).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from ajet.errors import AjetError

DEFAULT_KIND = "chat"


class InitError(AjetError, ValueError):
    """The target folder cannot take the project (not empty without --force, or not a folder)."""


def kinds() -> list[str]:
    """The project kinds, in the order `ajet init --help` lists them."""
    from ajet.init_templates import KINDS

    return list(KINDS)


def project_name(directory: Path) -> str:
    """The experiment name for a project folder: its name, with characters other than letters, digits, `_`, `-`
    and `.` replaced by `_` (it names `experiments/<name>/`)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", directory.resolve().name).strip("._")
    return name or "ajet_project"


def render_files(kind: str, name: str, python: str) -> dict[str, str]:
    """The project's files, {path relative to the project folder: text}, with `{{project}}` and `{{python}}`
    filled in.

    Args:
        kind: one of `kinds()`. name: the experiment name. python: the interpreter the programs ajet starts
            should run with (written as a quoted YAML string).

    Raises:
        InitError: an unknown kind.
    """
    from ajet.init_templates import KINDS

    if kind not in KINDS:
        raise InitError(f"unknown project kind {kind!r}; choose one of: {', '.join(KINDS)}")
    return {path: text.replace("{{project}}", name).replace("{{python}}", json.dumps(python))
            for path, text in KINDS[kind].FILES.items()}


def init_project(directory: str | Path, kind: str = DEFAULT_KIND, force: bool = False,
                 python: str | None = None) -> list[Path]:
    """Write the `kind` project into `directory` (created when missing); returns the files written.

    Args:
        directory: the project folder. kind: one of `kinds()`. force: write into a folder that is not empty
            (the template's files are overwritten, other files are left as they are).
        python: the interpreter written into command and harness configs (default: the one running this).

    Raises:
        InitError: an unknown kind, `directory` is a file, or it is not empty and `force` is false.
    """
    directory = Path(directory)
    files = render_files(kind, project_name(directory), python or sys.executable)
    if directory.exists() and not directory.is_dir():
        raise InitError(f"{directory} is a file, not a folder: name a new folder for the project")
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if present and not force:
        shown = ", ".join(present[:5]) + (f" and {len(present) - 5} more" if len(present) > 5 else "")
        raise InitError(f"{directory} is not empty (it holds {shown}): name a new folder, or pass --force to write "
                        f"the project's {len(files)} files into it (files of the same name are overwritten)")
    written = []
    for rel, text in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def next_steps(directory: Path, kind: str) -> str:
    """What `ajet init` prints after writing: the files' kind, and the commands to train and to look."""
    from ajet.init_templates import KINDS

    module = KINDS[kind]
    name = getattr(module, "EXPERIMENT", None) or project_name(directory)
    cd = "" if directory.resolve() == Path.cwd().resolve() else f"cd {shlex.quote(str(directory))} && "
    lines = [f"Wrote {module.SUMMARY}.", "", "Train it (the bundled SmolLM2-135M-Instruct, on CPU or one GPU):",
             f"  {cd}ajet --conf {getattr(module, 'CONFIG_FILE', 'ajet.yaml')} --backbone=debug", "",
             f"Then browse its episodes: ajet view experiments/{name}"]
    if kind == "harness" and (missing := judge_needs(kind)):
        lines.append(missing)
    return "\n".join(lines)


def judge_needs(kind: str) -> str | None:
    """What the `kind` project's judge needs and this Python lacks, said in one line with what to install (the
    harness project's tests judge runs pytest); None when nothing is missing."""
    if kind != "harness":
        return None
    from ajet.judges.tests import TestsJudgeUnavailable, require_pytest

    try:
        require_pytest()
    except TestsJudgeUnavailable as exc:
        return f"Before training: {exc}"
    return None


def main(directory: str, kind: str, force: bool) -> int:
    """`ajet init`: write the project, print the next command. Returns 0.

    Raises:
        InitError: see `init_project`.
    """
    path = Path(directory)
    written = init_project(path, kind, force)
    for file in written:
        print(f"  {file}")
    print(next_steps(path, kind))
    return 0
