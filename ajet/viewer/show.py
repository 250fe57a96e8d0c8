"""`ajet show EXP_DIR [--step N] [--episode ID]`: the viewer's token view in the terminal, with rich.

Without `--episode`: a table per step (reward, failures) and the episodes of `--step` (default: the last).
With `--episode`: its calls (messages, tool results, answer), then every sample token by token, trained
tokens (loss mask 1) bold on a background shaded by the engine's probability (green likely .. red
unlikely), untrained tokens grey, `[call n]` where a call's tokens start and `[sampled n]` where its
completion starts, `[fork]` where the sample leaves an earlier one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ajet.progress import unwrapped_when_piped
from ajet.viewer.run_reader import NotFound, RunReader

UNTRAINED = "grey50"
MARKER = "bold white on grey30"


def prob_style(logprob: float) -> str:
    """Rich style of a trained token: bold black on a background from green (p=1) to red (p=0)."""
    p = math.exp(logprob)
    r, g = int(230 - 90 * p), int(150 + 90 * p)
    return f"bold black on rgb({r},{g},150)"


def sample_text(s: dict[str, Any]) -> Text:
    """One sample (`RunReader.sample_tokens`) as rich Text: one span per token, styled by loss mask/logprob."""
    text = Text()
    starts = {c["start"]: c for c in s["calls"]}
    comps = {c["completion_start"]: c for c in s["calls"]}
    for i, (tok, m, lp) in enumerate(zip(s["text"], s["loss_mask"], s["logprobs"])):
        if i in starts:
            text.append(f"[call {starts[i]['index']}]", MARKER)
        if i in comps:
            text.append(f"[sampled {comps[i]['index']}]", "bold white on green4")
        if s.get("fork_at") == i:
            text.append(f"[fork: {s['flags'].get('fork_reason', 'leaves an earlier sample')}]", "bold white on red3")
        text.append(printable(tok), prob_style(lp) if m and lp is not None else UNTRAINED)
    return text


def printable(text: str) -> str:
    """`text` safe for a terminal: control characters (ESC...) as \\xNN, newlines and tabs kept."""
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                   for c in text)


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def show(exp_dir: str | Path, step: int | None = None, episode: str | None = None,
         console: Console | None = None) -> None:
    """Print the run (steps and one step's episodes) or one episode token by token.

    Raises:
        AjetError: no trajectories.sqlite in `exp_dir`; NotFound: no such step or episode.
    """
    run = RunReader(exp_dir)
    console = console or unwrapped_when_piped(Console(highlight=False))   # piped: whole ids, usable with --episode
    if episode is not None:
        _show_episode(run, episode, console)
        return
    steps = run.steps()
    table = Table(title=f"{run.exp_dir}", title_justify="left")
    for col in ("step", "attempt", "episodes", "failed", "tasks", "reward mean", "min", "max"):
        table.add_column(col, justify="right")
    for s in steps:
        table.add_row(*(_fmt(s[k]) for k in ("step", "attempt", "episodes", "failed", "tasks", "reward_mean",
                                             "reward_min", "reward_max")))
    console.print(table)
    if not steps:
        return
    step = steps[-1]["step"] if step is None else step
    page = run.episodes(step=step, limit=500)
    if page["total"] == 0:
        raise NotFound(f"step {step} has no episodes; steps recorded: {', '.join(str(s['step']) for s in steps)}")
    table = Table(title=f"step {step}: {page['total']} episodes (ajet show {exp_dir} --episode ID)", title_justify="left")
    for col in ("episode", "group"):   # never cut: `--episode` takes the id as printed
        table.add_column(col, no_wrap=True, min_width=max((len(e[f"{col}_id"]) for e in page["episodes"]), default=1))
    for col in ("reward", "advantage", "seconds", "calls", "samples", "forks", "failure"):
        table.add_column(col)
    for e in page["episodes"]:
        table.add_row(e["episode_id"], e["group_id"], _fmt(e["reward"]), _fmt(e["advantage"]), _fmt(e["duration_s"]),
                      str(e["calls"]), str(e["samples"]), ", ".join(e["fork_reasons"]),
                      Text(e["failure"] or "", style="red"))
    console.print(table)


def _show_episode(run: RunReader, episode_id: str, console: Console) -> None:
    ep = run.episode(episode_id)
    _rule(console, Text(f"episode {ep['episode_id']} · step {ep['step']} · group {ep['group_id']} · reward {_fmt(ep['reward'])}"))
    console.print(Text("task: ", style="bold") + Text((ep.get("task") or {}).get("query", "")))
    if ep.get("error"):
        console.print(Text(ep["error"].strip(), style="red"))
    seen: set[str] = set()
    for c in ep["calls"]:
        timings = c.get("timings") or {}
        console.print(Text(f"call {c['index']} · agent {c.get('agent_tag')} · policy v{c.get('policy_version')} · "
                           f"finish {c.get('finish_reason')} · {c['prompt_tokens']}+{c['completion_tokens']} tokens · "
                           f"{_fmt(timings.get('total_s'))} s · {_parent(c)}", style="bold cyan"))
        for m in c.get("messages") or []:
            key = json.dumps(m, sort_keys=True)
            if key in seen:   # each call repeats the history: print only what is new
                continue
            seen.add(key)
            console.print(Text(f"  {m.get('role')}: ", style="bold") + Text(printable(_content(m))))
        console.print(Text("  -> ", style="bold green") + Text(printable(_content(c.get("response_message") or {}))))
    answer = (ep.get("output") or {}).get("final_answer")
    console.print(Text("final answer: ", style="bold") + Text(printable(str(answer))))
    meta = (ep.get("output") or {}).get("metadata") or {}
    for test_id, result in (meta.get("tests") or {}).items():      # a repository task's tests (ajet/judges/tests.py)
        console.print(Text(f"  {result:<8}", style="green" if result == "passed" else "red") + Text(test_id))
    if isinstance(meta.get("diff"), str):
        console.print(Text("what the agent changed:", style="bold"))
        console.print(Text(printable(meta["diff"] or "(no change)")))
    for summary in ep["samples"]:
        s = run.sample_tokens(episode_id, summary["index"], ep["attempt"])
        _rule(console, Text(f"sample {s['index']} · agent {s['agent_tag']} · advantage {_fmt(s['advantage'])} · "
                          f"{sum(s['loss_mask'])} trained of {len(s['ids'])} tokens · flags {s['flags']}"))
        legend = (Text("trained", prob_style(-0.1)) + Text(" / ") + Text("unlikely trained", prob_style(-5.0))
                  + Text("  ") + Text("not trained", UNTRAINED))
        console.print(legend)
        if s["tokenizer"]:
            console.print(Text(s["tokenizer"], style="yellow"))
        console.print(sample_text(s))
    if not ep["samples"]:
        console.print(Text("no samples (a failed episode is not trained on)", style="yellow"))


def _rule(console: Console, title: Text) -> None:
    """A heading: rich's rule on a terminal; in a file or a pipe (no width to fill) the title between dashes."""
    if console.is_terminal:
        console.rule(title)
    else:
        console.print(Text("── ") + title + Text(" ──"))


def _parent(call: dict[str, Any]) -> str:
    """How the call's prompt was built: extends its parent (found by a tool-call id the proxy issued, or by
    text), or rendered in full (and why)."""
    if call.get("prompt_parent"):
        return f"extends {call['prompt_parent']} (parent found by {call.get('prompt_parent_by') or 'text'})"
    return f"rendered in full ({call.get('prompt_render_reason')})"


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content) if content else ""
    for t in message.get("tool_calls") or []:
        fn = t.get("function") or {}
        text += f" -> {fn.get('name')}({fn.get('arguments')})"
    return text
