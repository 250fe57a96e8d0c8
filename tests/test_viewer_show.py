"""`ajet show` (the token view in the terminal, rich) on a real tiny-model experiment folder."""

import json
import os
import sqlite3
import subprocess
import sys

from rich.text import Text


def ajet_show(*args, color=False):
    env = {**os.environ, "COLUMNS": "160"}
    if color:
        env["FORCE_COLOR"] = "1"
    env.pop("NO_COLOR", None)
    return subprocess.run([sys.executable, "-m", "ajet", "show", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_show_lists_steps_and_a_steps_episodes(tiny_experiment):
    out = ajet_show(tiny_experiment, "--step", 1)
    assert out.returncode == 0, out.stderr
    for eid in ("s1-t0-r0", "s1-t1-r2"):
        assert eid in out.stdout
    assert out.stdout.count("RuntimeError: the lookup service is down") == 3
    assert "step 2" not in out.stdout and "step 1: 6 episodes" in out.stdout


def test_show_episode_colours_trained_and_untrained_tokens_apart(tiny_experiment):
    db = sqlite3.connect(tiny_experiment / "trajectories.sqlite")
    eid, record = db.execute("SELECT episode_id, record FROM samples WHERE step = 2 LIMIT 1").fetchone()
    db.close()
    sample = json.loads(record)
    out = ajet_show(tiny_experiment, "--episode", eid, color=True)
    assert out.returncode == 0, out.stderr
    text = Text.from_ansi(out.stdout)
    plain = text.plain
    assert "TOOL RESULT 42" in plain and "[sampled 0]" in plain and "[call 1]" in plain
    assert "rendered in full (first_call)" in plain and "(parent found by text)" in plain   # how call 1 found call 0

    def style_at(pos):
        return {str(span.style) for span in text.spans if span.start <= pos < span.end}

    tool_styles = style_at(plain.rindex("TOOL RESULT 42"))
    sampled = plain.rindex("[sampled 1]") + len("[sampled 1]")   # the first token call 1 sampled (trained)
    trained_styles = style_at(sampled)
    assert sample["loss_mask"][-1] == 1
    assert tool_styles and trained_styles and tool_styles != trained_styles
    assert any("bold" in s for s in trained_styles) and not any("bold" in s for s in tool_styles)


def test_show_errors_name_what_to_fix(tiny_experiment, tmp_path):
    out = ajet_show(tmp_path)
    assert out.returncode == 2 and "holds no trajectories.sqlite" in out.stderr
    out = ajet_show(tiny_experiment, "--episode", "nope")
    assert out.returncode == 2 and "no episode 'nope'" in out.stderr
    out = ajet_show(tiny_experiment, "--step", 7)
    assert out.returncode == 2 and "step 7 has no episodes" in out.stderr


def test_each_step_counts_how_calls_found_their_parents(tiny_experiment):
    """The tiny workflow replays its first reply as text with no tool call (12 tokens): by text, never by id."""
    rows = [json.loads(line) for line in (tiny_experiment / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "merge/parent_by_text" in r]
    assert steps and all(r["merge/parent_by_id"] == 0 and r["merge/parent_by_text"] >= 1 for r in steps)
