"""Progress of the long phases of a run: a rich live display on a terminal, plain lines in a log.

Every long phase (a held-out evaluation, a step's rollout, the update, a checkpoint write, `ajet eval`,
`ajet serve`'s episodes) opens a phase of the process's reporter and advances it:

    with progress.phase("eval step 0", total=160) as p:     # episodes
        ...
        p.advance(1, pass1=0.42, failed=1)                   # one more done; fields shown beside the count

    progress.active("rollout")                               # the open phase of that name (or None), for code
                                                             # that only adds to a phase someone else opened

What is shown depends on where stdout goes:

    a terminal   a rich live display (transient bars: done/total, the fields, rate, elapsed, ETA) on the run's
                 own console, so `console.print` lines (the step lines) and writes to stdout/stderr (logging)
                 print above it, whole;
    anything else  (CI, `> log`) one plain line per open phase every `interval_s` seconds (default 30:
                 `trainer.progress_interval_s`, or the environment variable AJET_PROGRESS_INTERVAL_S), also
                 when nothing advanced, so a log tells a slow run (the count moves) from a hung one (it does
                 not, the elapsed time grows);
    off          `--quiet` or `trainer.progress: false`: nothing.

In a log, the run's console never hard-wraps a line (`unwrapped_when_piped`) and the libraries' own progress bars
are off (`quiet_library_bars`). A phase's ETA counts from its first finished unit (`Phase.eta`); a run's overall
ETA (steps left x the recent step time, the first step's warm-up left out, plus the evaluations still to come, the
one after the last step included) is `RunEta`.

The reporter is one per process (`configure` replaces it); until configured, phases show nothing.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from types import TracebackType
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

INTERVAL_ENV = "AJET_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 30.0


LOG_WIDTH = 1000   # columns a table may take in a log (it takes what it needs; lines are never wrapped)


def unwrapped_when_piped(console: Console) -> Console:
    """`console`, changed when it writes to a file or a pipe (not a terminal, nor Jupyter): printed lines are not
    hard-wrapped (rich's `soft_wrap`; rich would break them at 80 columns, its default width without a terminal)
    and tables take their natural width (up to `LOG_WIDTH` columns), unless the environment sets COLUMNS."""
    if not console.is_terminal and not console.is_jupyter:
        console.soft_wrap = True
        if not os.environ.get("COLUMNS"):
            console.width = LOG_WIDTH
    return console


def quiet_library_bars() -> None:
    """Turn off the progress bars of Hugging Face's libraries (transformers' "Loading weights", the hub's
    downloads): in a log they are lines of carriage returns. Here through transformers' logging API (when it is
    imported) and for processes started from now on (HF_HUB_DISABLE_PROGRESS_BARS, read at their import)."""
    import sys

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def fmt_duration(seconds: float) -> str:
    """`seconds` as "45s", "12m05s" or "3h07m" (for ETAs and elapsed times)."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_score(key: str, value: float, before: float | None = None, episodes: float | None = None) -> str:
    """An evaluation score as the docs write it: a pass@k as a percentage with one decimal, pass@1 with its passed
    episodes of `episodes` ("pass@1 10.6% (17/160)"), beside its value `before` with the change in points
    ("pass@1 13.8% -> 59.4% (+45.6 points, 95/160)"); any other score (reward_mean) to 3 decimals
    ("reward_mean 0.400 -> 0.520"). pass@1 is the mean over tasks of passed/n with n episodes each, so
    pass@1 x episodes is the number passed."""
    if not key.startswith("pass@"):
        return f"{key} {value:.3f}" if before is None else f"{key} {before:.3f} -> {value:.3f}"
    count = f"{round(value * episodes)}/{episodes:.0f}" if key == "pass@1" and episodes else ""
    if before is None:
        return f"{key} {100 * value:.1f}%" + (f" ({count})" if count else "")
    change = f"{100 * (value - before):+.1f} points"
    return f"{key} {100 * before:.1f}% -> {100 * value:.1f}% ({change}{', ' + count if count else ''})"


class Phase:
    """One open phase: `done` of `total` units (episodes, mini-batches; total None: not counted) and named
    fields (`failed`, `pass@1`, `tokens`, ...). Thread-safe; a context manager that closes it.

    A field named `tokens` (a count) is also shown as a rate, tok/s over the phase's elapsed time.
    """

    def __init__(self, reporter: Reporter, name: str, total: int | None, fields: dict[str, Any]):
        self.reporter, self.name, self.total, self.fields = reporter, name, total, dict(fields)
        self.done = 0
        self.started = time.monotonic()
        self.first_done: float | None = None   # when the first unit finished (`eta`)
        self.closed = False
        self._lock = threading.Lock()
        self._task: Any = None   # the rich task id, in live mode

    def advance(self, n: int = 1, **fields: Any) -> None:
        """`n` more units done; `fields` replace the shown fields of those names."""
        self.set(advance=n, **fields)

    def set(self, *, total: int | None = None, advance: int = 0, **fields: Any) -> None:
        """Change the total (e.g. dynamic sampling's extra tasks), the done count, and fields."""
        with self._lock:
            if total is not None:
                self.total = total
            self.done += advance
            if self.done and self.first_done is None:
                self.first_done = time.monotonic()
            self.fields.update(fields)
        self.reporter._changed(self)

    def elapsed(self) -> float:
        """Seconds since the phase opened."""
        return time.monotonic() - self.started

    def eta(self) -> float | None:
        """Seconds left: the units left at the rate they have finished since the first one did; None before two
        have (or without a total), 0 when all are done.

        Not the mean rate since the phase opened: units run at once (64 episodes in flight) all take about one
        episode's time to finish the first, so `elapsed / done` is one episode's time, not the throughput, and
        the first ETAs of a 160-episode evaluation came out 10-60x too long. The time to the first finished
        unit (warm-up, filling the pipeline) is left out; from then on units finish at the throughput.
        """
        with self._lock:
            done, total, first = self.done, self.total, self.first_done
        if total is None or first is None:
            return None
        if done >= total:
            return 0.0
        since_first = time.monotonic() - first
        if done < 2 or since_first <= 0:
            return None
        return (total - done) * since_first / (done - 1)

    def fields_text(self) -> str:
        """The fields as "failed 1 | pass@1 0.42 | 12.3 tok/s" (floats to 3 significant figures)."""
        with self._lock:
            fields = dict(self.fields)
        parts = []
        for k, v in fields.items():
            if v is None or v == "":
                continue
            if k == "tokens":
                elapsed = self.elapsed()
                parts.append(f"{v / elapsed:.3g} tok/s" if elapsed > 0 else "")
            elif k == "status":
                parts.append(str(v))
            else:
                parts.append(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}")
        return " | ".join(p for p in parts if p)

    def line(self) -> str:
        """The plain line of this phase: "eval step 0: 40/160 (25%) | failed 1 | 0.8/s | elapsed 50s | ETA 2m30s"."""
        with self._lock:
            done, total = self.done, self.total
        elapsed = self.elapsed()
        count = f"{done}/{total} ({done / total:.0%})" if total else f"{done}"
        parts = [f"{self.name}: {count}", self.fields_text(),
                 f"{done / elapsed:.2g}/s" if done and elapsed > 0 else "", f"elapsed {fmt_duration(elapsed)}"]
        eta = self.eta()
        if eta is not None:
            parts.append(f"ETA {fmt_duration(eta)}")
        return " | ".join(p for p in parts if p)

    def close(self) -> None:
        """End the phase (its bar disappears). Idempotent."""
        if not self.closed:
            self.closed = True
            self.reporter._closed(self)

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class _EtaColumn(ProgressColumn):
    """The live display's time left: the phase's own `Phase.eta` ("-:--:--" while unknown)."""

    def render(self, task: Any) -> Text:
        eta = task.fields["phase"].eta()
        return Text(fmt_duration(eta) if eta is not None else "-:--:--", style="progress.remaining")


class Reporter:
    """Shows the open phases on `console`: live (a terminal), plain lines every `interval_s` (not a terminal),
    or nothing (`enabled` False; also when `console` is None).

    Args:
        console: the run's rich console (the one that prints the step lines), or None.
        enabled: False shows nothing (`--quiet`, `trainer.progress: false`).
        interval_s: seconds between two plain lines of a phase (> 0). Default: AJET_PROGRESS_INTERVAL_S, else 30.
        live: force the live display (True) or plain lines (False); default: whether `console` is a terminal.

    Raises:
        ValueError: `interval_s` is not > 0.
    """

    def __init__(self, console: Console | None = None, enabled: bool = True, interval_s: float | None = None,
                 live: bool | None = None):
        self.console = console
        self.enabled = enabled and console is not None
        self.interval_s = interval_s if interval_s is not None else default_interval_s()
        if self.interval_s <= 0:
            raise ValueError(f"the progress interval must be > 0 seconds, got {self.interval_s}")
        self.live = (console.is_terminal if console is not None else False) if live is None else live
        self._phases: list[Phase] = []
        self._lock = threading.Lock()
        self._bars: Progress | None = None
        self._ticker: threading.Thread | None = None
        self._wake = threading.Event()

    def phase(self, name: str, total: int | None = None, **fields: Any) -> Phase:
        """Open a phase of `total` units named `name`; use it as a context manager (or `close()` it)."""
        p = Phase(self, name, total, fields)
        if not self.enabled:
            return p
        with self._lock:
            self._phases.append(p)
            if self.live:
                if self._bars is None:
                    self._bars = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                          TextColumn("{task.fields[text]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                          _EtaColumn(), console=self.console, transient=True)
                    self._bars.start()
                p._task = self._bars.add_task(name, total=total, text=p.fields_text(), phase=p)
            elif self._ticker is None or not self._ticker.is_alive():
                self._wake.clear()
                self._ticker = threading.Thread(target=self._tick, name="ajet-progress", daemon=True)
                self._ticker.start()
        return p

    def active(self, name: str) -> Phase | None:
        """The newest open phase whose name starts with `name` (None when there is none)."""
        with self._lock:
            return next((p for p in reversed(self._phases) if p.name.startswith(name)), None)

    def _changed(self, p: Phase) -> None:
        bars = self._bars
        if bars is not None and p._task is not None and not p.closed:
            bars.update(p._task, completed=p.done, total=p.total, text=p.fields_text())

    def _closed(self, p: Phase) -> None:
        with self._lock:
            if p not in self._phases:
                return
            self._phases.remove(p)
            if self._bars is not None and p._task is not None:
                self._bars.remove_task(p._task)
                if not self._phases:
                    self._bars.stop()
                    self._bars = None
            if not self._phases:
                self._wake.set()   # the ticker ends; the next phase starts another

    def _tick(self) -> None:
        """Plain mode: every `interval_s`, one line per open phase that has been open that long."""
        while not self._wake.wait(self.interval_s):
            with self._lock:
                phases = list(self._phases)
            for p in phases:
                if not p.closed and p.elapsed() >= self.interval_s:
                    self.console.print(p.line(), markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        """Close every open phase (end of the run)."""
        for p in list(self._phases):
            p.close()


def default_interval_s() -> float:
    """AJET_PROGRESS_INTERVAL_S when set (seconds), else 30."""
    raw = os.environ.get(INTERVAL_ENV)
    return float(raw) if raw else DEFAULT_INTERVAL_S


_quiet = False
_reporter = Reporter(None, enabled=False)


def set_quiet(quiet: bool = True) -> None:
    """`--quiet`: no progress at all, and `note` prints nothing, whatever the config says."""
    global _quiet
    _quiet = quiet


def quiet() -> bool:
    """Whether `--quiet` was given."""
    return _quiet


def configure(console: Console | None, enabled: bool = True, interval_s: float | None = None) -> Reporter:
    """Make a reporter on `console` the process's (closing the previous one's phases) and return it. Off under
    `--quiet`. Without the live display (a log, or progress off), the libraries' own progress bars are turned off
    too (`quiet_library_bars`). The plain-line interval: AJET_PROGRESS_INTERVAL_S when set, else `interval_s`
    (the config's `trainer.progress_interval_s`), else 30 s.

    Raises:
        ValueError: the interval is not a number > 0.
    """
    global _reporter
    _reporter.close()
    env = os.environ.get(INTERVAL_ENV)
    _reporter = Reporter(console, enabled and not _quiet, float(env) if env else interval_s)
    if not (_reporter.live and _reporter.enabled):   # a log (or nothing shown): no library's bars in it either
        quiet_library_bars()
    return _reporter


def reset() -> None:
    """Close the process's reporter's phases and put back the unconfigured one (it shows nothing), as at import: the
    end of a run, so that what runs after it in the same process (a second run, a notebook's next cell, a test)
    draws no live display on the finished run's console, which would hold sys.stdout/stderr while it draws."""
    global _reporter
    _reporter.close()
    _reporter = Reporter(None, enabled=False)


def episode_counter(p: Phase, pass_threshold: float, then: Callable[[Any], None] | None = None) -> Callable[[Any], None]:
    """An `on_episode_done(episode)` callback for an evaluation: advances `p` by one per finished episode with
    `pass@1` so far (passed / finished: reward >= `pass_threshold`, a failed episode not passed), `failed` and
    `timeouts` (failed with a TimeoutError) so far; then calls `then(episode)` (when given)."""
    from ajet.failures import failure_kind

    counts = {"passed": 0, "failed": 0, "timeouts": 0, "done": 0}
    lock = threading.Lock()

    def done(ep: Any) -> None:
        with lock:
            counts["done"] += 1
            counts["passed"] += bool(ep.ok and ep.reward is not None and ep.reward >= pass_threshold)
            counts["failed"] += not ep.ok
            counts["timeouts"] += bool(not ep.ok and failure_kind(ep.error or "") == "TimeoutError")
            fields = {"pass@1": counts["passed"] / counts["done"], "failed": counts["failed"],
                      "timeouts": counts["timeouts"]}
        p.advance(1, **fields)
        if then is not None:
            then(ep)

    return done


def reporter() -> Reporter:
    """The process's reporter."""
    return _reporter


def phase(name: str, total: int | None = None, **fields: Any) -> Phase:
    """Open a phase on the process's reporter (see `Reporter.phase`)."""
    return _reporter.phase(name, total, **fields)


def active(name: str) -> Phase | None:
    """The process's newest open phase whose name starts with `name` (see `Reporter.active`)."""
    return _reporter.active(name)


def note(console: Console, text: str) -> None:
    """Print an informational line (a header, "model loaded") on `console`, except under `--quiet`."""
    if not _quiet:
        console.print(text)


class RunEta:
    """A run's time left: steps left x the mean time of the recent steps, measured between step ends without the
    evaluations in them (a window of `window` steps), plus the evaluations still to come: the validations due at
    the end of the steps left (`evals`) and the test set's evaluation after the last step (`after`), each as the
    last evaluation measured in this run (`evaluated`) scaled to its number of episodes. Before any evaluation is
    measured (`trainer.val_before_train: false`, a resumed run) the evaluations to come are left out.

    The first step measured is left out once a later one is in: it carries the run's one-time costs (the first
    generation and update allocate and warm the engine and the optimizer), up to 8x a later step's time on the
    tiny model, so an ETA from it alone would be that much too long for the whole run. The step-0 evaluation is
    never counted as step time: the clock starts when the estimator is made (after it) or at `start`.

    Args:
        total_steps: the run's last step; window: how many recent step times are averaged (>= 1); evals: the
            episodes of the evaluation due at the end of each step that has one ({step: episodes}); after: the
            episodes evaluated after the last step (0: none).
    """

    def __init__(self, total_steps: int, window: int = 5, evals: dict[int, int] | None = None, after: int = 0):
        self.total_steps = total_steps
        self.evals, self.after = dict(evals or {}), after
        self._times: deque[float] = deque(maxlen=max(1, window))
        self._first: float | None = None   # the first step's time, until a later one replaces it
        self._eval_rate: float | None = None   # seconds per episode of the last evaluation measured
        self._last = time.monotonic()

    def start(self) -> None:
        """The first step starts now (after the step-0 evaluation, which is not a step)."""
        self._last = time.monotonic()

    def evaluated(self, seconds: float, episodes: float) -> None:
        """An evaluation of `episodes` episodes took `seconds`: the estimate of those to come (ignored when empty)."""
        if episodes > 0:
            self._eval_rate = seconds / episodes

    def step_done(self, step: int, eval_s: float = 0.0) -> float | None:
        """Record that `step` ended now, `eval_s` seconds of it an evaluation (left out of its step time; give the
        evaluation to `evaluated` too); the seconds left after it (None after the last step)."""
        now = time.monotonic()
        took, self._last = now - self._last - eval_s, now
        if self._first is None and not self._times:
            self._first = took
        else:
            self._times.append(took)
        left = self.total_steps - step
        if left <= 0:
            return None
        steps = (sum(self._times) / len(self._times) if self._times else self._first) * left
        episodes = sum(n for s, n in self.evals.items() if step < s <= self.total_steps) + self.after
        return steps + (self._eval_rate or 0.0) * episodes
