"""A workflow, judge or task-generator module that fails while it is imported is said in one line, exit 2: the role,
the file and line, the exception; a SyntaxError its own line; a missing package of one of ajet's extras the extra
to install (pyproject.toml's optional-dependencies). Real `python -m ajet` runs on the tiny model's config (they
stop before the model loads), and `ajet init --kind math`'s LangChain and AgentScope variants with their packages
hidden from the run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from ajet.cli import main
from ajet.config import load_config
from ajet.errors import WorkflowLoadError
from ajet.importing import EXTRAS, load_object
from ajet.judges import load_judge
from ajet.tasks.generator import read_generator_tasks

REPO = Path(__file__).resolve().parents[1]
# runs `ajet` with the named modules hidden (as if their packages were not installed): `-c CODE mod1,mod2 ARGS`
HIDING = ("import sys; [sys.modules.__setitem__(m, None) for m in sys.argv[1].split(',') if m]; "
          "from ajet.cli import main; sys.exit(main(sys.argv[2:]))")

NAME_ERROR = '''"""A workflow whose module refers to a name it never defined."""
from ajet.workflow import Workflow

HELPER = fooo

class W(Workflow):
    async def execute(self, task, tuner):
        pass
'''
SYNTAX_ERROR = '''from ajet.workflow import Workflow


class W(Workflow):
    async def execute(self, task, tuner)
        pass
'''


def _ajet(cwd: Path, *args: str, hide: str = "") -> tuple[int, str, str]:
    """`python -m ajet ARGS` in `cwd` (with the modules `hide`, comma-separated, not importable): (status, out, err)."""
    proc = subprocess.run([sys.executable, "-c", HIDING, hide, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc.returncode, proc.stdout, proc.stderr


def _project(tmp_path: Path, tiny_model_dir: str, workflow: str, extra: str = "") -> Path:
    (tmp_path / "train.jsonl").write_text('{"task_id": "t0", "query": "Say 0."}\n')
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        experiment_name: broken
        workflow: {workflow}
        model: {{path: "{tiny_model_dir}", max_model_len: 512}}
        data: {{train_path: train.jsonl}}
        trainer: {{total_steps: 1, tasks_per_step: 1, tensorboard: false}}
    """) + extra)
    return tmp_path / "conf.yaml"


@pytest.mark.parametrize("source, said", [
    (NAME_ERROR, "ajet: error: workflow wf.py:4: NameError: name 'fooo' is not defined"),
    (SYNTAX_ERROR, "ajet: error: workflow wf.py:5: SyntaxError: expected ':'"),
], ids=["NameError", "SyntaxError"])
def test_a_workflow_that_fails_on_import_is_one_line_with_its_file_and_line(source, said, tiny_model_dir, tmp_path):
    (tmp_path / "wf.py").write_text(source)
    conf = _project(tmp_path, tiny_model_dir, "wf.py:W")
    rc, out, err = _ajet(tmp_path, "--conf", str(conf), "--exp-dir", "exp")
    assert rc == 2, out + err
    assert err == said + "\n", err                         # one line, no traceback
    assert not (tmp_path / "exp").exists()                 # nothing written before the run could start


@pytest.mark.parametrize("variant, hide, said", [
    ("math_agent_langchain.yaml", "langchain_core,langchain_openai,langgraph",
     r"workflow math_workflow_langchain\.py:(\d+): ModuleNotFoundError: No module named 'langchain_core' "
     r"\(pip install 'ajet\[langchain\]'\)"),
    ("math_agent_agentscope.yaml", "agentscope",
     r"workflow math_workflow_agentscope\.py:(\d+): ModuleNotFoundError: No module named 'agentscope' "
     r"\(pip install 'ajet\[agentscope\]'\)"),
], ids=["langchain", "agentscope"])
def test_the_math_jobs_framework_variants_without_their_packages_name_the_extra(variant, hide, said, tmp_path, capsys):
    project = tmp_path / "math"
    assert main(["init", str(project), "--kind", "math"]) == 0
    capsys.readouterr()
    rc, out, err = _ajet(project, "--conf", variant, "--exp-dir", "exp", hide=hide)
    assert rc == 2, out + err
    m = re.fullmatch(f"ajet: error: {said}\n", err)
    assert m, err
    module = project / re.search(r"math_workflow_\w+\.py", said.replace("\\", "")).group(0)
    line = module.read_text().splitlines()[int(m.group(1)) - 1]
    assert line.startswith("from ") and hide.split(",")[0] in line, line   # the file's own import line
    assert not (project / "exp").exists()


def test_every_package_of_ajets_extras_names_its_extra():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, requirements in extras.items():
        if extra in ("test", "docs", "verl", "trinity"):   # not imported by a user's workflow
            continue
        for req in requirements:
            module = re.match(r"[A-Za-z0-9_.-]+", req).group(0).replace("-", "_")
            assert EXTRAS.get(module) == extra, (module, extra)


def test_a_judge_and_a_task_generator_that_fail_on_import_are_named_by_role(tmp_path, monkeypatch):
    (tmp_path / "judge.py").write_text("import json\n\n\nraise RuntimeError('set JUDGE_KEY first')\n")
    (tmp_path / "gen.py").write_text("def tasks(split):\n    yield {}\n\nimport not_a_module_x9\n")
    (tmp_path / "pkg_x9").mkdir()
    (tmp_path / "pkg_x9" / "__init__.py").write_text("")
    (tmp_path / "pkg_x9" / "wf.py").write_text("X = 1\nY = 1 / 0\n")
    (tmp_path / "conf.yaml").write_text("workflow: wf.py:W\njudge: judge.py:score\ndata: {train_path: t.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(WorkflowLoadError) as caught:
        load_judge(load_config(tmp_path / "conf.yaml"))
    assert str(caught.value) == "judge judge.py:4: RuntimeError: set JUDGE_KEY first"
    with pytest.raises(WorkflowLoadError) as caught:
        read_generator_tasks("gen.py:tasks", "train", {}, tmp_path)
    assert str(caught.value) == ("task generator gen.py:4: ModuleNotFoundError: No module named 'not_a_module_x9' "
                                 f"(not installed in the Python running ajet, {sys.executable})")
    with pytest.raises(WorkflowLoadError) as caught:          # `module:Name`: the same line
        load_object("pkg_x9.wf:W")
    assert str(caught.value) == f"workflow {os.path.join('pkg_x9', 'wf.py')}:2: ZeroDivisionError: division by zero"
