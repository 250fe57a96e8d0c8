"""The tool sandbox holds against each escape a model-written program might try (issue 9, item 16).

Each test runs real code in the real sandbox. The escapes need bubblewrap; where it does not work the tests
that need it are skipped with the reason, unless AJET_REQUIRE_BWRAP=1 (set by CI, which installs it), where
they fail instead.
"""

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from ajet.tools import sandbox
from ajet.tools.sandbox import SandboxUnavailable, bwrap_status, run_python, run_python_async

BWRAP, WHY_NOT = bwrap_status()
if not BWRAP and os.environ.get("AJET_REQUIRE_BWRAP") == "1":
    raise RuntimeError(f"AJET_REQUIRE_BWRAP=1 but bubblewrap does not work here: {WHY_NOT}")
needs_bwrap = pytest.mark.skipif(not BWRAP, reason=f"bubblewrap unavailable: {WHY_NOT}")
SECRET = "sk-ajet-test-" + uuid.uuid4().hex


@pytest.fixture()
def secret_env(monkeypatch):
    monkeypatch.setenv("AJET_TEST_API_KEY", SECRET)


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_environment_is_an_allow_list(secret_env, isolation):
    r = run_python("import os; print(sorted(os.environ)); print(os.environ.get('AJET_TEST_API_KEY'))",
                   isolation=isolation, env={"TOOL_MODE": "x"})
    assert r.ok and r.isolation == isolation, r
    assert SECRET not in r.stdout and "None" in r.stdout and "TOOL_MODE" in r.stdout


PROC_SNOOP = """
import glob, os
seen = []
for path in glob.glob("/proc/*/environ") + ["/proc/TRAINER_PID/environ"]:
    try:
        seen.append(open(path, "rb").read().decode(errors="replace"))
    except OSError as exc:
        seen.append(repr(exc))
print("\\n".join(seen))
"""
# A stand-in trainer: a process started with the secret in its environment (so /proc/<pid>/environ holds it)
# that runs the snooping code through the sandbox and prints what the code printed.
TRAINER = """
import os, sys
from ajet.tools.sandbox import run_python
r = run_python(sys.argv[1].replace("TRAINER_PID", str(os.getpid())), isolation=sys.argv[2],
               max_output_bytes=1 << 24)
print(r.isolation, r.returncode, r.stdout)
"""


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_cannot_read_the_trainers_proc_environ(isolation):
    env = {**os.environ, "AJET_TEST_API_KEY": SECRET}
    out = subprocess.run([sys.executable, "-c", TRAINER, PROC_SNOOP, isolation], env=env, capture_output=True,
                         text=True, timeout=60).stdout
    assert out.startswith(f"{isolation} 0"), out
    if isolation == "bwrap":
        assert SECRET not in out
    elif os.geteuid() == 0:   # without isolation, code run by root reads it: why "none" is reported as such
        assert SECRET in out


@needs_bwrap
def test_no_network_not_even_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError as exc:
    print("refused", exc)
"""
        r = run_python(code, isolation="bwrap")
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()      # nothing reached the trainer's listener
    assert r.ok and "refused" in r.stdout and "CONNECTED" not in r.stdout, r


@needs_bwrap
def test_fork_bomb_is_capped():
    code = """
import os, time
pids = []
for _ in range(100):
    try:
        pid = os.fork()
    except OSError as exc:
        print("fork refused:", exc.strerror)
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    pids.append(pid)
print("forked", len(pids))
"""
    r = run_python(code, isolation="bwrap", max_processes=16, timeout_s=10)
    forked = int(r.stdout.split("forked")[1].split()[0])
    assert "fork refused" in r.stdout and forked < 16, r


@needs_bwrap
def test_grandchild_in_its_own_session_dies_at_the_timeout():
    token = "ajet-orphan-" + uuid.uuid4().hex
    code = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # {token}"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("spawned", flush=True)
time.sleep(60)
"""
    r = run_python(code, isolation="bwrap", timeout_s=1.5)
    assert r.timed_out and "spawned" in r.stdout and r.wall_s < 5, r
    deadline = time.monotonic() + 3
    while _processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(token) == []


def test_process_group_killed_at_the_timeout_without_isolation():
    token = "ajet-child-" + uuid.uuid4().hex
    code = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # {token}"])
time.sleep(60)
"""
    r = run_python(code, isolation="none", timeout_s=1.5)
    assert r.timed_out and r.isolation == "none" and "none" in r.isolation_note, r
    deadline = time.monotonic() + 3
    while _processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(token) == []


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_printing_200_mib_is_truncated_with_a_marker(isolation):
    code = "import sys\nblock = b'x' * (1 << 20)\nfor _ in range(200):\n    sys.stdout.buffer.write(block)\n"
    r = run_python(code, isolation=isolation, timeout_s=20, max_output_bytes=4096)
    assert r.ok and r.truncated, r.stderr
    assert r.stdout.startswith("x" * 4096) and len(r.stdout) < 4096 + 100
    assert f"{200 * (1 << 20) - 4096} more bytes dropped" in r.stdout


@needs_bwrap
def test_cannot_kill_the_parent():
    code = f"""
import os, signal
for pid in (os.getppid(), {os.getpid()}, 1):
    try:
        os.kill(pid, signal.SIGKILL)
        print("sent", pid)
    except OSError as exc:
        print("refused", pid, exc.strerror)
try:
    os.killpg({os.getpgid(0)}, signal.SIGKILL)
except OSError as exc:
    print("refused group", exc.strerror)
print("done")
"""
    r = run_python(code, isolation="bwrap")
    assert f"refused {os.getpid()}" in r.stdout and "refused group" in r.stdout, r
    assert run_python("print('still here')", isolation="bwrap").stdout == "still here\n"


@needs_bwrap
def test_file_size_limit_and_a_private_working_directory(tmp_path):
    (tmp_path / "trainer_secret.txt").write_text(SECRET)
    code = f"""
import os
print("cwd", os.getcwd(), sorted(os.listdir(".")))
try:
    open({str(tmp_path / 'trainer_secret.txt')!r}).read(); print("READ SECRET")
except OSError as exc:
    print("no secret:", exc.strerror)
try:
    with open("big.bin", "wb") as f:
        f.write(b"x" * (3 << 20))
    print("WROTE 3 MiB")
except OSError as exc:
    print("write refused:", exc.strerror)
try:
    open({os.path.abspath(__file__)!r}, "a").write("#")
    print("MODIFIED THE REPO")
except OSError as exc:
    print("repo read-only or hidden:", exc.strerror)
"""
    r = run_python(code, isolation="bwrap", max_file_mb=1, files={"data/input.txt": "hello"})
    assert r.ok, r
    assert "cwd /sandbox ['data', 'main.py']" in r.stdout
    assert "no secret" in r.stdout and "READ SECRET" not in r.stdout
    assert "write refused: File too large" in r.stdout and "MODIFIED THE REPO" not in r.stdout


def test_results_are_honest_without_bubblewrap(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    bwrap_status.cache_clear()
    try:
        r = run_python("print(6 * 7)")
        assert r.ok and r.stdout == "42\n" and r.isolation == "none" and "not installed" in r.isolation_note
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
            run_python("print(1)", isolation="bwrap")
    finally:
        bwrap_status.cache_clear()


def test_memory_timeout_and_exit_codes():
    ok = run_python("import sys; print(sum(map(int, sys.stdin.read().split())))", stdin="1 2 3")
    assert ok.ok and ok.stdout.strip() == "6" and ok.isolation == ("bwrap" if BWRAP else "none")
    hang = run_python("while True: pass", timeout_s=1.0)
    assert hang.timed_out and not hang.ok and hang.returncode is None
    hog = run_python("x = bytearray(2 * 1024**3); print('allocated')", memory_mb=256)
    assert not hog.ok and "MemoryError" in hog.stderr and "allocated" not in hog.stdout
    assert run_python("raise SystemExit(3)").returncode == 3


def test_files_must_stay_inside_the_working_directory():
    with pytest.raises(ValueError, match="outside the working directory"):
        run_python("pass", files={"../escape.py": "x"})


def test_async_runs_do_not_block_the_event_loop():
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(ticker())
        slow = await asyncio.gather(*(run_python_async("import time; time.sleep(1.5); print('done')")
                                      for _ in range(3)))
        t.cancel()
        return slow, ticks

    start = time.monotonic()
    results, ticks = asyncio.run(main())
    assert all(r.ok and r.stdout == "done\n" for r in results)
    assert time.monotonic() - start < 4.0     # three 1.5 s tools ran at once, not one after another
    assert ticks >= 15                        # the loop kept running meanwhile


def _processes_with(token: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if token.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(int(pid))
            except OSError:
                pass
    return found


@needs_bwrap
def test_a_python_whose_venv_lives_under_tmp_still_runs_sandboxed():
    """The private /tmp was mounted over the interpreter's folders: a venv under /tmp made bwrap fail
    (`execvp .../bin/python: No such file`), the probe report isolation "none" and the escape tests skip."""
    import ajet

    repo = os.path.dirname(os.path.dirname(os.path.abspath(ajet.__file__)))
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="ajet-venv-") as d:
        venv = os.path.join(d, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True,
                       timeout=120)
        code = "import os, sys; open('/tmp/scratch', 'w').write('x'); print(sys.prefix, sorted(os.listdir('/tmp')))"
        trainer = ("import sys; from ajet.tools.sandbox import bwrap_status, run_python; print(bwrap_status()); "
                   f"r = run_python({code!r}, isolation='bwrap'); print(r.isolation, r.returncode, r.stdout, r.stderr)")
        out = subprocess.run([os.path.join(venv, "bin", "python"), "-c", trainer], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": repo})
        assert out.returncode == 0, out.stderr[-2000:]
        probe, result = out.stdout.split("\n", 1)
        assert probe == "(True, '')", out.stdout
        # the code ran under bwrap with the venv's interpreter, and /tmp is its own, writable and otherwise empty
        assert result.startswith(f"bwrap 0 {venv} {sorted([os.path.basename(d), 'scratch'])}"), result


def test_without_bubblewrap_the_run_warns_at_start_and_the_tool_promises_no_isolation(tmp_path, monkeypatch,
                                                                                      caplog):
    """Isolation "none" said nowhere a person looks, and the model read "No network" anyway: now the MCP
    hub (the trainer's start) and the sandbox server (its log) warn, and the description drops the promise."""
    from ajet.config import ToolsConfig
    from ajet.tools.mcp_hub import McpHub

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)      # this process: no bwrap
    bwrap_status.cache_clear()
    servers = {"sandbox": {"command": "python", "args": ["-m", "ajet.tools.sandbox_server"],
                           "env": {"PATH": str(tmp_path)}}}                 # the server's process: none either
    try:
        with caplog.at_level("WARNING"), McpHub(ToolsConfig(mcp_servers=servers), log_dir=tmp_path) as hub:
            (schema,) = hub.schemas
            description = schema["function"]["description"]

            async def call():
                return await (await hub.open_episode()).call("run_python", {"code": "print(6 * 7)"})
            result = asyncio.run(call())
    finally:
        bwrap_status.cache_clear()
    assert "network" not in description.lower() and description.startswith("Run a Python 3 program"), description
    assert result.text.startswith("42\n\n[isolation: none: bubblewrap (bwrap) is not installed"), result.text
    assert "'sandbox' (ajet's code sandbox): the code sandbox runs WITHOUT isolation" in caplog.text
    assert "the proxy's port" in caplog.text
    assert "WARNING  ajet sandbox server: the code" in (tmp_path / "mcp_sandbox.log").read_text()   # rich wraps it


@needs_bwrap
def test_with_bubblewrap_the_tool_says_no_network_and_nothing_warns(caplog):
    from ajet.tools.sandbox_server import build_server

    with caplog.at_level("WARNING"):
        (tool,) = asyncio.run(build_server().list_tools())
        assert run_python("print(1)").isolation == "bwrap"
    assert tool.description.endswith("No network.") and "WITHOUT isolation" not in caplog.text
