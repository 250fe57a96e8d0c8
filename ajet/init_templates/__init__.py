"""The projects `ajet init --kind KIND` writes (ajet/commands/init.py writes them), one module per kind.

Each module holds `FILES`, {path relative to the project folder: text}, and `SUMMARY`, one line on what the
project is. In the text, `{{project}}` is replaced by the project's name and `{{python}}` by the interpreter that
ran `ajet init`, as a quoted YAML string (the programs ajet starts need one with the `openai` package). Each
project is a small real one that trains as written against the bundled SmolLM2-135M-Instruct: a config, the code
of one episode, a few tasks and a reward. `math` is the main job itself (ajet/init_templates/math_job.py): the
tutorial's files as they are, whose module also names its `CONFIG_FILE` and `EXPERIMENT` (the others: ajet.yaml
and the project's name).
"""

from __future__ import annotations

from types import ModuleType

from ajet.init_templates import chat, command, harness, math_job, mcp

KINDS: dict[str, ModuleType] = {"chat": chat, "command": command, "harness": harness, "mcp": mcp, "math": math_job}
