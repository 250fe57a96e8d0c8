"""`ajet init --kind harness`: a coding agent on repository tasks, judged by each task's tests.

The harness is the project's own (a 15-line program in the config), so the project runs with nothing to install;
the config says how to put a registered coding-agent CLI (`ajet harnesses`) in its place.
"""

import json

from ajet.tasks.repo import DEFAULT_TEST_COMMAND

SUMMARY = ("a coding agent on repository tasks: a harness (a program defined in the config) edits a fresh copy "
           "of a small repository per episode; the share of its named tests that pass is the reward")

CONFIG = r'''# {{project}}: a coding agent trained on repository tasks (written by `ajet init --kind harness`).
# Run from this folder (the tests judge needs pytest: pip install pytest):
#   ajet --conf ajet.yaml --backbone=debug        outputs go to experiments/{{project}}/
# Each episode: the task's repository (repos/NAME) is copied fresh, the harness runs once in the copy (in a
# sandbox without network and without your files when bubblewrap is installed; every model call goes through
# the episode's proxy), then the task's test command runs there: the reward is the share of the task's named
# tests that pass. Every key is in ajet's configuration reference (docs/configuration.md).
experiment_name: {{project}}
workflow:
  harness: fix-agent                    # defined below. A registered coding-agent CLI instead, e.g.
                                        # `harness: mini-swe-agent` (`ajet harnesses` lists them; installed
                                        # into ~/.cache/ajet/harnesses on first use)
  timeout_s: 300                        # per episode (the harness; the tests then run under test_timeout_s)
harnesses:
  fix-agent:                            # any program that does one task non-interactively
    # the interpreter that ran `ajet init` (it has the openai package); a program on PATH works too
    executable: {{python}}
    api: chat                           # it speaks Chat Completions to the proxy
    argv: ["{home}/fix_agent.py", "{instruction}"]
    env: {OPENAI_BASE_URL: "{base_url}", OPENAI_API_KEY: "{api_key}", MODEL: "{model}"}
    files:                              # written into the harness's fresh HOME before each episode
      fix_agent.py: |
        # A minimal coding agent: shows the model the task and the module, writes back the corrected module.
        # It runs in a fresh copy of the task's repository (its working folder).
        import os
        import re
        import sys
        from pathlib import Path

        from openai import OpenAI       # OPENAI_BASE_URL and OPENAI_API_KEY: the episode's proxy

        module = sorted(Path(".").glob("*.py"))[0]
        prompt = (sys.argv[1] + "\n\nThis is " + module.name + ":\n```python\n" + module.read_text() + "```\n"
                  "Reply with the whole corrected " + module.name + " in one ```python block.")
        reply = OpenAI().chat.completions.create(model=os.environ["MODEL"], messages=[
            {"role": "user", "content": prompt}]).choices[0].message.content or ""
        code = re.search(r"```(?:python)?\n(.*?)```", reply, re.DOTALL)
        if code:
            module.write_text(code.group(1))
        print("rewrote " + module.name if code else "no python block in the reply")
model:
  path: smollm2-135m-instruct           # the bundled SmolLM2-135M-Instruct; or a Hugging Face id or a folder
  max_model_len: 2048
data:
  train_path: tasks.jsonl               # repository tasks: repo, test_command, tests (the named test ids)
rollout:
  num_repeat: 4                         # episodes per task: one GRPO group
  temperature: 0.8
  max_tokens: 200                       # per call: the whole corrected module
trainer:
  total_steps: 8
  tasks_per_step: 2
algorithm:
  lr: 1.0e-5
'''

# each repository: (module source with the bug, its tests, the issue text, the named tests)
REPOS = {
    "clamp": ('''\
def clamp(x, low, high):
    """x limited to the range [low, high]."""
    return max(low, min(x, low))
''', '''\
from clamp import clamp


def test_inside():
    assert clamp(5, 0, 10) == 5


def test_above():
    assert clamp(15, 0, 10) == 10


def test_below():
    assert clamp(-3, 0, 10) == 0
''', "clamp(15, 0, 10) returns 0, and so does clamp(5, 0, 10). clamp(x, low, high) must return x limited to the "
     "range [low, high]. Fix clamp.py.", ["test_inside", "test_above", "test_below"]),
    "average": ('''\
def average(numbers):
    """The arithmetic mean of a non-empty list of numbers."""
    return sum(numbers) / (len(numbers) - 1)
''', '''\
from average import average


def test_three():
    assert average([1, 2, 3]) == 2


def test_one():
    assert average([4]) == 4
''', "average([1, 2, 3]) returns 3.0 instead of 2, and average([4]) raises ZeroDivisionError. Fix average.py.",
        ["test_three", "test_one"]),
    "last_word": ('''\
def last_word(text):
    """The last whitespace-separated word of text ("" for a blank text)."""
    words = text.split()
    return words[0] if words else ""
''', '''\
from last_word import last_word


def test_sentence():
    assert last_word("the quick brown fox") == "fox"


def test_one_word():
    assert last_word("  hello ") == "hello"


def test_blank():
    assert last_word("   ") == ""
''', 'last_word("the quick brown fox") returns "the"; it must return the last word, "fox". Fix last_word.py.',
        ["test_sentence", "test_one_word", "test_blank"]),
}

TASKS = "".join(json.dumps({"task_id": name, "query": issue, "repo": f"repos/{name}",
                            "test_command": DEFAULT_TEST_COMMAND,
                            "tests": [f"tests/test_{name}.py::{t}" for t in tests]}) + "\n"
                for name, (_, _, issue, tests) in REPOS.items())

FILES = {"ajet.yaml": CONFIG, "tasks.jsonl": TASKS,
         **{f"repos/{name}/{name}.py": module for name, (module, _, _, _) in REPOS.items()},
         **{f"repos/{name}/tests/test_{name}.py": tests for name, (_, tests, _, _) in REPOS.items()}}
