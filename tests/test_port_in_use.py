"""A port another process holds: `ajet serve`, `ajet gateway` and `ajet view` print one line naming the port and
the flag that changes it, exit non-zero, with no traceback, and before the model loads (nothing is written). A
server whose own bind loses a race for the port after the check says the same line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ajet.trajectory_store import TrajectoryStore
from tests.tiny_experiment import WORKFLOW


@pytest.fixture
def held_port():
    """A port on 127.0.0.1 that this test process listens on (as another server would)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def conf(tmp_path, tiny_model_dir) -> Path:
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task_id": "t0", "query": "What is 1 plus 1?",
                                                      "answer": "2"}) + "\n")
    path = tmp_path / "conf.yaml"
    path.write_text(yaml.safe_dump({"experiment_name": "port", "workflow": "wf.py:ToolLoopWorkflow",
                                    "model": {"path": tiny_model_dir}, "data": {"train_path": "tasks.jsonl"},
                                    "trainer": {"total_steps": 1}}))
    return path


def _run(args: list[str], cwd: Path, out: Path, timeout_s: float = 120) -> tuple[int, str]:
    """Run `python -m ajet ARGS` with stdout and stderr to the file `out`; returns (exit status, the output)."""
    with out.open("w") as f:
        rc = subprocess.run([sys.executable, *args], cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                            timeout=timeout_s).returncode
    return rc, out.read_text()


def _assert_one_line(rc: int, text: str, port: int) -> None:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert rc != 0, text
    assert "Traceback" not in text and "Errno" not in text, text
    assert len(lines) == 1, text
    assert f"port {port} " in lines[0] and "--port" in lines[0], lines[0]


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_server_on_a_held_port_says_one_line_before_loading(command, held_port, conf, tmp_path):
    rc, text = _run(["-m", "ajet", command, "--conf", str(conf), "--port", str(held_port), "--exp-dir", "exp"],
                    tmp_path, tmp_path / "out.txt")
    _assert_one_line(rc, text, held_port)
    assert f"{command}.port" in text
    assert not (tmp_path / "exp").exists()   # refused before the run started (and before the model loaded)


def test_view_on_a_held_port_says_one_line_and_prints_no_url(held_port, tmp_path):
    TrajectoryStore(tmp_path / "exp" / "trajectories.sqlite").close()   # a run's folder, with no episodes yet
    rc, text = _run(["-m", "ajet", "view", "exp", "--port", str(held_port)], tmp_path, tmp_path / "out.txt")
    _assert_one_line(rc, text, held_port)
    assert "http://" not in text


RACE = """
import sys
import ajet.ports as ports

real, calls = ports.check_port, []


def passes_first(*args):   # the check before loading finds the port free; the port is taken right after
    calls.append(args)
    if len(calls) > 1:
        real(*args)


ports.check_port = passes_first
from ajet.cli import main

rc = main(sys.argv[1:])
assert len(calls) == 2, calls
sys.exit(rc)
"""


def test_serve_losing_the_race_for_its_port_says_the_same_line(held_port, conf, tmp_path):
    """The proxy's own bind fails after the model loaded: the same line, not an OSError traceback."""
    (tmp_path / "race.py").write_text(RACE)
    rc, text = _run(["race.py", "serve", "--conf", str(conf), "--port", str(held_port), "--exp-dir", "exp", "-q"],
                    tmp_path, tmp_path / "out.txt", timeout_s=300)
    assert rc == 2, text
    assert "Traceback" not in text, text
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"ajet: error: port {held_port} on 127.0.0.1 is already in use") and "--port" in last
