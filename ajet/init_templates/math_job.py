"""`ajet init --kind math`: the main job as the repository runs it (tutorial/example_math_agent): GRPO on the
bundled SmolLM2-135M-Instruct with a tool-using math agent, 16 steps, validation and test sets before and after. The
files are the tutorial's own, installed with ajet as package data (ajet/shipped.py), written as they are (the
configs keep their experiment names), with the variants for AgentScope, LangChain, httpx and distillation.
"""

from __future__ import annotations

from typing import Any

SUMMARY = ("the main job: a tool-using math agent (math_workflow.py: a calculator tool, a judge of the final "
           "number) trained with GRPO on 512 arithmetic problems, 64 held out to pick its best checkpoint and 160 "
           "to test it; variants for AgentScope, LangChain, httpx and distillation beside it")
CONFIG_FILE = "math_agent.yaml"   # the config `ajet init` tells the user to train
EXPERIMENT = "math_agent"         # its experiment_name: outputs go to experiments/math_agent/
PATTERNS = ("*.py", "*.yaml", "tasks/*.jsonl")   # what ships (pyproject.toml's package data, plus the modules)


def files() -> dict[str, str]:
    """{path relative to the project folder: text} of the main job's files, read from the installed package."""
    from ajet.shipped import shipped_folder

    root = shipped_folder("ajet.init_templates.example_math_agent")
    return {p.relative_to(root).as_posix(): p.read_text() for pattern in PATTERNS
            for p in sorted(root.glob(pattern)) if p.name != "__init__.py"}


def __getattr__(name: str) -> Any:   # FILES is read when `ajet init --kind math` writes, not at import
    if name == "FILES":
        return files()
    raise AttributeError(name)
