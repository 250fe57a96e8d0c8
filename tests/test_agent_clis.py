"""Real agent CLIs, unmodified, against the real proxy: Claude Code (`@anthropic-ai/claude-code`, Messages
API through `ANTHROPIC_BASE_URL`), OpenAI's Codex CLI (`@openai/codex`, Responses API through a
provider in its config file) and Gemini CLI (`@google/gemini-cli`, Gemini API through
`GOOGLE_GEMINI_BASE_URL` + `GEMINI_API_KEY`, with `security.auth.selectedType: gemini-api-key` in its
settings), each driven non-interactively for one short tool task.

The scripted engine makes the CLI run one shell command (`echo 4`), then answers; the CLI's own 20-80 KB
system prompt and 10-25 tools go through the proxy, and the episode must merge into one exact sample.
The CLIs are found on PATH, or installed once with npm into `$AJET_NPM_PREFIX` (default
`~/.cache/ajet/npm`); without node/npm, or without the network to install them, the tests are skipped
with the reason. (Running them as command workflows under `ajet serve` is the `ajet serve` issue's.)
Claude Code spends about a minute of its run outside any API call here (its own start-up and shutdown
without network); its two calls take under a second of proxy time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from tests.exact_sample import assert_one_exact_sample
from tests.scripted_engine import ScriptedEngine

PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex", "gemini": "@google/gemini-cli"}
TASK = "What is 2+2? Use the shell, then answer briefly."


def _cli(name: str) -> str:
    """The CLI's executable: on PATH, in the npm prefix, or installed there now. Skips with the reason."""
    prefix = Path(os.environ.get("AJET_NPM_PREFIX", Path.home() / ".cache" / "ajet" / "npm"))
    found = shutil.which(name) or shutil.which(name, path=str(prefix / "node_modules" / ".bin"))
    if found:
        return found
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip(f"{name}: node/npm are not installed (needed for {PACKAGES[name]})")
    try:
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), PACKAGES[name]],
                       check=True, capture_output=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        out = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"{name}: could not install {PACKAGES[name]} with npm (no network?): {out[-300:]!r}")
    found = shutil.which(name, path=str(prefix / "node_modules" / ".bin"))
    if not found:
        pytest.skip(f"{name}: {PACKAGES[name]} installed no `{name}` executable")
    return found


@pytest.fixture
def short_tmp():
    """A folder of its own with a short path (not under pytest's tree; the CLIs' sockets need short paths),
    removed after the test."""
    folder = Path(tempfile.mkdtemp(prefix="ajet-cli-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _run(tokenizer, tool_call: dict | list[dict], command) -> tuple[subprocess.CompletedProcess, list, ScriptedEngine]:
    """Serve one episode whose engine calls `tool_call` (or each of a list, one call a turn) then answers; run
    `command(endpoint)` -> (argv, env, cwd)."""
    tool_calls = tool_call if isinstance(tool_call, list) else [tool_call]
    engine = ScriptedEngine(tokenizer, ["<tool_call>\n" + json.dumps(tc) + "\n</tool_call>" for tc in tool_calls]
                            + ["The answer is 4."])
    # the tiny test tokenizer spends about one token per byte of these CLIs' 20-80 KB prompts
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=128), max_model_len=10**6).start()
    try:
        ep = proxy.open_episode("cli")
        argv, env, cwd = command(ep)
        result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300,
                                stdin=subprocess.DEVNULL)
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    return result, calls, engine


def test_claude_code_runs_a_tool_episode_into_one_sample(tokenizer, short_tmp):
    claude = _cli("claude")
    tmp_path = short_tmp

    def command(ep):
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": ep.anthropic_base_url,
               "ANTHROPIC_API_KEY": ep.api_key, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
        return [claude, "-p", TASK, "--output-format", "json", "--model", "claude-sonnet-4-5",
                "--allowedTools", "Bash"], env, str(tmp_path)

    result, calls, engine = _run(tokenizer, {"name": "Bash", "arguments": {"command": "echo 4",
                                                                           "description": "Print 4"}}, command)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["result"] == "The answer is 4."
    assert [c.api for c in calls] == ["messages", "messages"] and len(calls[0].tools) >= 10
    assert len(calls[0].messages[0]["content"]) > 10_000               # Claude Code's own system prompt
    sample, bridges = assert_one_exact_sample(calls, engine)
    assert "4" in tokenizer.decode(bridges[0])                          # the Bash output, loss mask 0


def test_claude_code_that_edits_a_file_is_one_sample(tokenizer, short_tmp):
    """Issue 22: Claude Code sends its `Edit` call back with the schema default `"replace_all": false` added;
    the later calls find their parent by the tool-call id the proxy issued, and the episode is one sample."""
    claude = _cli("claude")
    work = short_tmp
    (work / "a.py").write_text("x = 1\n")

    def command(ep):
        env = {"PATH": os.environ["PATH"], "HOME": str(work), "ANTHROPIC_BASE_URL": ep.anthropic_base_url,
               "ANTHROPIC_API_KEY": ep.api_key, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
        return [claude, "-p", "Set x to 2 in a.py.", "--output-format", "json", "--model", "claude-sonnet-4-5",
                "--allowedTools", "Read,Edit,Bash"], env, str(work)

    path = str(work / "a.py")
    result, calls, engine = _run(tokenizer, [
        {"name": "Read", "arguments": {"file_path": path}},
        {"name": "Edit", "arguments": {"file_path": path, "old_string": "x = 1", "new_string": "x = 2"}},
        {"name": "Bash", "arguments": {"command": "cat a.py", "description": "Show a.py"}}], command)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (work / "a.py").read_text() == "x = 2\n" and len(calls) == 4
    replayed = json.loads(calls[2].messages[-2]["tool_calls"][0]["function"]["arguments"])
    assert replayed.get("replace_all") is False                         # a default the model never wrote
    assert [c.prompt_parent_by for c in calls] == ["none", "id", "id", "id"]
    assert_one_exact_sample(calls, engine)


def test_codex_cli_runs_a_tool_episode_into_one_sample(tokenizer, tmp_path):
    codex = _cli("codex")

    def command(ep):
        home = tmp_path / "codex-home"
        home.mkdir()
        (home / "config.toml").write_text(
            'model = "ajet-policy"\nmodel_provider = "ajet"\n[model_providers.ajet]\nname = "ajet"\n'
            f'base_url = "{ep.base_url}"\nenv_key = "AJET_API_KEY"\nwire_api = "responses"\n')
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(home), "AJET_API_KEY": ep.api_key}
        return [codex, "exec", "--skip-git-repo-check", TASK], env, str(tmp_path)

    result, calls, engine = _run(tokenizer, {"name": "exec_command", "arguments": {"cmd": "echo 4"}}, command)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "The answer is 4." in result.stdout
    assert [c.api for c in calls] == ["responses", "responses"] and len(calls[0].tools) >= 10
    assert len(calls[0].messages[0]["content"]) > 10_000               # Codex's own instructions
    assert_one_exact_sample(calls, engine)


def test_gemini_cli_runs_a_tool_episode_into_one_sample(tokenizer, short_tmp):
    gemini = _cli("gemini")
    home = short_tmp
    (home / ".gemini").mkdir()
    (home / ".gemini" / "settings.json").write_text(json.dumps({
        "security": {"auth": {"selectedType": "gemini-api-key"}}, "privacy": {"usageStatisticsEnabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}))

    def command(ep):
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "GEMINI_API_KEY": ep.api_key,
               "GOOGLE_GEMINI_BASE_URL": ep.gemini_base_url, "GEMINI_CLI_TRUST_WORKSPACE": "true"}
        return [gemini, "-p", TASK, "--yolo", "-m", "gemini-2.5-flash", "-o", "json"], env, str(home)

    result, calls, engine = _run(tokenizer, {"name": "run_shell_command", "arguments": {
        "command": "echo 4", "description": "Print 4"}}, command)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["response"] == "The answer is 4."
    assert [c.api for c in calls] == ["gemini", "gemini"] and len(calls[0].tools) >= 10
    assert calls[1].prompt_parent_by == "id"                           # its functionCall id, sent back
    sample, bridges = assert_one_exact_sample(calls, engine)
    assert "4" in tokenizer.decode(bridges[0])                          # the shell's output, loss mask 0
