"""Merging on real harness traces: Codex CLI, Claude Code and Gemini CLI,
each unmodified, in the sandbox, through a scripted 13-call edit-and-test episode on a small Python project.

The scripted engine plays a competent model (tests/scripted_engine.py): list the files, read the module and its
test, run the failing test, fix it with the harness's own edit tool, rerun, add a function `spread` and its test
file, run them, look again, answer. The harness's real prompt, tools and replay of the history go through the
real proxy (ajet/harnesses/workflow.py), tokenized with SmolLM2's tokenizer. Printed per harness:

    calls, samples            recorded calls; samples after the context tracker merged them (1 = no fork)
    forks                     samples started anew, by reason (the sample's `fork_reason`)
    tokens merged / per call  training tokens (prompt + completion of each sample) merged vs one sample per call
    ratio                     per call / merged (higher: the merge saves more)
    prompt KB/call            mean JSON size of a call's messages + tools, KB
    proxy ms/call             the proxy's own wall time per call (total - generate), median and first call
    CPU ms/call               the proxy's CPU time per call (its event-loop and prepare threads; the scripted
                              engine's replies are tokenized beforehand, so it costs next to nothing): from one
                              call's start of generation to the next, i.e. answering a call + preparing the next;
                              median over calls 2..n, and the last call
    calls/s                   1000 / the mean CPU ms per call: what one core could serve at that cost

Wall times depend on the machine's load; CPU times much less (the load average is printed with them).

    python benchmarks/harness_merge.py [--harness codex claude-code] [--tokenizer smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ajet.config import HarnessWorkflowConfig  # noqa: E402
from ajet.harnesses.registry import builtin_harnesses, install  # noqa: E402
from ajet.harnesses.workflow import HarnessWorkflow  # noqa: E402
from ajet.llm_call import SamplingParams  # noqa: E402
from ajet.model import load_tokenizer  # noqa: E402
from ajet.proxy.server import ProxyServer  # noqa: E402
from ajet.task import Task  # noqa: E402
from ajet.tools.workdir_sandbox import SANDBOX_DIR  # noqa: E402
from ajet.tracker import merge_calls  # noqa: E402
from ajet.workflow import Tuner  # noqa: E402
from tests.scripted_engine import ScriptedEngine  # noqa: E402

TASKS = ROOT / "tutorial" / "example_swe_tasks"
TEST = "python -m pytest -q -rA -p no:cacheprovider"
BUG, FIX = "return (s[mid - 1] + s[mid]) / 3", "return (s[mid - 1] + s[mid]) / 2"
SPREAD = "def spread(values):\n    return max(values) - min(values)\n"
SPREAD_TEST = "from median import spread\n\n\ndef test_spread():\n    assert spread([3, 9, 4]) == 6\n"


def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def codex_script() -> list[str]:
    def patch(body: str) -> str:
        return f"apply_patch <<'EOF'\n*** Begin Patch\n{body}*** End Patch\nEOF"

    def test(cmd: str = TEST) -> str:   # waits up to 60 s for pytest's output (Codex's default wait is shorter)
        return _call("exec_command", cmd=cmd, yield_time_ms=60000)

    add = "".join("+" + line + "\n" for line in ("", "",) + tuple(SPREAD.splitlines()))
    return [_call("exec_command", cmd="ls -R"), _call("exec_command", cmd="cat median.py"),
            _call("exec_command", cmd="cat tests/test_median.py"), test(),
            _call("exec_command", cmd=patch(f"*** Update File: median.py\n@@\n-    {BUG}\n+    {FIX}\n")),
            test(),
            _call("exec_command", cmd=patch(f"*** Update File: median.py\n@@\n     {FIX}\n{add}")),
            _call("exec_command", cmd=patch("*** Add File: tests/test_spread.py\n"
                                            + "".join("+" + line + "\n" for line in SPREAD_TEST.splitlines()))),
            test(), _call("exec_command", cmd="cat tests/test_spread.py"),
            _call("exec_command", cmd="grep -n def median.py"), test(TEST + " -k spread"),
            "Fixed median and added spread with its test."]


def claude_script() -> list[str]:
    mod, test = f"{SANDBOX_DIR}/median.py", f"{SANDBOX_DIR}/tests/test_median.py"
    return [_call("Bash", command="ls -R", description="List files"), _call("Read", file_path=mod),
            _call("Read", file_path=test), _call("Bash", command=TEST, description="Run the tests"),
            _call("Edit", file_path=mod, old_string=BUG, new_string=FIX),
            _call("Bash", command=TEST, description="Rerun the tests"),
            _call("Edit", file_path=mod, old_string=FIX, new_string=FIX + "\n\n\n" + SPREAD.rstrip("\n")),
            _call("Write", file_path=f"{SANDBOX_DIR}/tests/test_spread.py", content=SPREAD_TEST),
            _call("Bash", command=TEST, description="Run all tests"),
            _call("Read", file_path=f"{SANDBOX_DIR}/tests/test_spread.py"),
            _call("Bash", command="grep -n def median.py", description="List functions"),
            _call("Bash", command=TEST + " -k spread", description="Run the new test"),
            "Fixed median and added spread with its test."]


def gemini_script() -> list[str]:
    mod, test = f"{SANDBOX_DIR}/median.py", f"{SANDBOX_DIR}/tests/test_median.py"

    def sh(command: str) -> str:
        return _call("run_shell_command", command=command)

    return [sh("ls -R"), _call("read_file", file_path=mod), _call("read_file", file_path=test), sh(TEST),
            _call("replace", file_path=mod, instruction="Divide the middle pair's sum by 2", old_string=BUG,
                  new_string=FIX),
            sh(TEST),
            _call("replace", file_path=mod, instruction="Add spread after median", old_string=FIX,
                  new_string=FIX + "\n\n\n" + SPREAD.rstrip("\n")),
            _call("write_file", file_path=f"{SANDBOX_DIR}/tests/test_spread.py", content=SPREAD_TEST),
            sh(TEST), _call("read_file", file_path=f"{SANDBOX_DIR}/tests/test_spread.py"),
            sh("grep -n def median.py"), sh(TEST + " -k spread"),
            "Fixed median and added spread with its test."]


SCRIPTS = {"codex": codex_script, "claude-code": claude_script, "gemini-cli": gemini_script}


def _proxy_cpu_s() -> float:
    """CPU seconds used so far by the proxy's threads (its event loop's and its prepare pool's)."""
    return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threading.enumerate()
               if t.name == "ajet-proxy" or t.name.startswith("ajet-prepare"))


class _TimedEngine(ScriptedEngine):
    """The scripted engine, replies tokenized beforehand (as ScriptedEngine would: text + end-of-turn), noting
    the proxy's CPU time at the start of each generation."""

    def __init__(self, tokenizer, replies: list[str]):
        super().__init__(tokenizer, [tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id]
                                     for r in replies])
        self.cpu_at: list[float] = []

    async def generate(self, prompt_ids, params, on_tokens=None):
        self.cpu_at.append(_proxy_cpu_s())
        return await super().generate(prompt_ids, params, on_tokens)


def run_one(name: str, tokenizer) -> dict:
    """One scripted episode of harness `name`: its figures (see the module docstring)."""
    spec = builtin_harnesses()[name]
    install(name, spec)
    replies = SCRIPTS[name]()
    assert all(len(tokenizer.encode(r, add_special_tokens=False)) < 511 for r in replies)   # never cut short
    engine = _TimedEngine(tokenizer, replies)
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=512), max_model_len=10**6).start()
    row = json.loads((TASKS / "tasks.jsonl").read_text().splitlines()[
        [json.loads(r)["task_id"] for r in (TASKS / "tasks.jsonl").read_text().splitlines()].index("median")])
    task = Task(row.pop("task_id"), row.pop("query"), None, row)
    workflow = HarnessWorkflow(HarnessWorkflowConfig(harness=name, timeout_s=600), None, TASKS)
    t0 = time.perf_counter()
    try:
        ep = proxy.open_episode(name)
        out = asyncio.run(workflow.execute(task, Tuner(base_url=ep.base_url, api_key=ep.api_key, model="ajet-policy",
                                                       episode_id=name)))
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    wall = time.perf_counter() - t0
    samples = merge_calls(calls, "g")
    merged = sum(len(s.input_ids) for s in samples)
    per_call = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    proxy_ms = [1000 * (c.timings.get("total_s", 0.0) - c.timings.get("generate_s", 0.0)) for c in calls]
    cpu_ms = [1000 * (b - a) for a, b in zip(engine.cpu_at, engine.cpu_at[1:])]   # answer call i-1 + prepare i
    forks = collections.Counter(s.flags.get("fork_reason", "?") for s in samples[1:])
    return {"harness": name, "version": spec.version, "api": spec.api, "calls": len(calls),
            "scripted": len(replies), "samples": len(samples), "forks": dict(forks), "tokens_merged": merged,
            "tokens_per_call": per_call, "ratio": per_call / merged if merged else float("nan"),
            "prompt_kb_per_call": statistics.mean(len(json.dumps(c.messages)) + len(json.dumps(c.tools or []))
                                                  for c in calls) / 1024 if calls else 0.0,
            "proxy_ms_median": statistics.median(proxy_ms) if proxy_ms else float("nan"),
            "proxy_ms_first": proxy_ms[0] if proxy_ms else float("nan"), "reward": out.reward,
            "cpu_ms_median": statistics.median(cpu_ms) if cpu_ms else float("nan"),
            "cpu_ms_last": cpu_ms[-1] if cpu_ms else float("nan"),
            "calls_per_s": 1000 / statistics.mean(cpu_ms) if cpu_ms else float("nan"),
            "exit_status": out.metadata["exit_status"], "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--harness", nargs="+", default=["codex", "claude-code", "gemini-cli"])
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct", help="model path or alias whose tokenizer is used")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print(f"{'harness':<12} {'api':<9} {'calls':>5} {'samples':>7} {'forks':<24} {'tokens merged':>13} "
          f"{'per call':>9} {'ratio':>6} {'prompt KB/call':>14} {'proxy ms/call med':>17} {'first':>7} "
          f"{'CPU ms/call med':>15} {'last':>6} {'calls/s':>7} {'reward':>6}")
    for name in args.harness:
        spec = builtin_harnesses()[name]
        if name not in SCRIPTS:
            print(f"{name:<12} {spec.api:<9} pending: no scripted 13-call episode for it yet")
            continue
        r = run_one(name, tokenizer)
        forks = ",".join(f"{k}:{v}" for k, v in r["forks"].items()) or "-"
        print(f"{name:<12} {r['api']:<9} {r['calls']:>5} {r['samples']:>7} {forks:<24} {r['tokens_merged']:>13} "
              f"{r['tokens_per_call']:>9} {r['ratio']:>6.1f} {r['prompt_kb_per_call']:>14.1f} "
              f"{r['proxy_ms_median']:>17.1f} {r['proxy_ms_first']:>7.1f} {r['cpu_ms_median']:>15.2f} "
              f"{r['cpu_ms_last']:>6.2f} {r['calls_per_s']:>7.0f} {r['reward']:>6}"
              + ("" if r["calls"] == r["scripted"] and r["exit_status"] == 0 else
                 f"   (!) {r['calls']} of {r['scripted']} scripted calls made, exit {r['exit_status']}"))
    print("load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
