"""Ctrl-C (SIGINT) and SIGTERM for every `ajet` command: the first one stops the command cleanly, in one line.

    with StopSignals() as stop:          # ajet/cli.py, around the command
        command(args)                    # the first signal raises `Stopped` (a KeyboardInterrupt) in it: its
                                         # `finally` blocks close the store, the proxy and the engine (server)
    stop.signum                          # the signal that stopped it, or None

The first signal mutes the process (its stdout and stderr file descriptors point at /dev/null, logging is off, and
errors of threads and of objects being collected are not printed) while the command's cleanup runs, so what the
proxy, asyncio or the engine say while they are torn down (cancelled requests, "Task exception was never
retrieved") never reaches the terminal; `StopSignals.__exit__` gives stdout and stderr back and the caller prints
its one line (`stopped_line`); logging and the error hooks stay off, as the process is ending. A second signal exits at once (`os._exit`) with the same status. Exit statuses are the shell's:
128 + the signal (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_stopping: list[int] = []   # the signal of the `StopSignals` stopping the process now (empty: none)
_active: list[StopSignals] = []     # the `StopSignals` installed now, innermost last (main thread only)


def stopping() -> bool:
    """Whether a stop signal is being handled (the command's cleanup runs after Ctrl-C or SIGTERM): cleanup that
    only adds to what is kept (the run's plots) is skipped, so the process ends promptly."""
    return bool(_stopping)


def signal_name(signum: int) -> str:
    """How a stop by `signum` is named to the user: "Ctrl-C" for SIGINT, else the signal's name ("SIGTERM")."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def exit_status(signum: int) -> int:
    """The exit status after a stop by `signum`, as a shell reports a process the signal ended: 128 + signum."""
    return 128 + signum


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by the first SIGINT or SIGTERM (`StopSignals`); a KeyboardInterrupt, so every
    `finally` and every `except KeyboardInterrupt` that cleans up after Ctrl-C runs for SIGTERM too.

    Args:
        signum: the signal received.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """The handlers of SIGINT and SIGTERM while a command runs (a context manager; the previous handlers are put
    back on exit). Installed only in the main thread (elsewhere Python refuses signal handlers): there it does
    nothing and `signum` stays None.

    The first signal sets `signum`, calls each of `on_stop` (e.g. a server's "stop now" event), mutes the process
    (see the module docstring) and raises `Stopped(signum)` where the main thread is. A second signal writes one
    line to the real stderr and ends the process at once with `exit_status(signum)` (nothing more is cleaned up).

    Args:
        on_stop: callables run on the first signal, in the main thread, before `Stopped` is raised.
    """

    def __init__(self, *on_stop: Callable[[], Any]):
        self.signum: int | None = None
        self.on_stop = list(on_stop)
        self._previous: dict[int, Any] = {}
        self._saved_fds: dict[int, int] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        _active.append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self in _active:
            _active.remove(self)
        if self.signum is not None and self.signum in _stopping:
            _stopping.remove(self.signum)
        self._unmute()

    @property
    def exit_status(self) -> int | None:
        """`exit_status(signum)` once a signal stopped the command, else None."""
        return None if self.signum is None else exit_status(self.signum)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:
            self._say(f"ajet: second {signal_name(signum)}: exiting now")
            os._exit(exit_status(self.signum))
        self.signum = signum
        _stopping.append(signum)
        for callback in self.on_stop:
            callback()
        self._mute()
        raise Stopped(signum)

    def _say(self, line: str) -> None:
        """Write `line` to the real stderr, muted or not."""
        with contextlib.suppress(OSError):
            os.write(self._saved_fds.get(2, 2), (line + "\n").encode())

    def _mute(self) -> None:
        """Point fds 1 and 2 at /dev/null (what Python buffered so far is flushed to the terminal first), turn
        logging off, and stop printing errors of threads and of objects being collected."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):   # a flush the signal interrupted cannot be repeated here
                stream.flush()
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                self._saved_fds[fd] = os.dup(fd)
                os.dup2(null, fd)
            os.close(null)
        logging.disable(logging.CRITICAL)
        threading.excepthook = lambda _args: None
        sys.unraisablehook = lambda _args: None

    def _unmute(self) -> None:
        """Give fds 1 and 2 back (for the caller's one line). Logging and the two error hooks stay off: the process
        is ending, and what is collected on the way out (asyncio's "Task exception was never retrieved") must not
        follow the line."""
        if not self._saved_fds:
            return
        for stream in (sys.stdout, sys.stderr):   # what the cleanup printed goes to /dev/null, not after the line
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, saved in self._saved_fds.items():
            with contextlib.suppress(OSError):
                os.dup2(saved, fd)
                os.close(saved)
        self._saved_fds.clear()


def reinstall() -> None:
    """Put the running command's handlers (the innermost `StopSignals`) back on SIGINT and SIGTERM, after a library
    replaced them: `ray.init` sets the driver's SIGTERM handler to `sys.exit(signum)` (ray/_private/worker.py,
    "This method overwrite sigterm handler of the driver process"), under which SIGTERM skipped the clean stop and
    the process ended in Ray's crash dump (exit 134). `ajet.ray_cluster.start_ray` calls it right after `ray.init`.
    Does nothing outside the main thread or when no `StopSignals` is installed."""
    if _active and threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, _active[-1]._handle)


def continue_command(argv: list[str], resume: bool) -> str:
    """The `ajet` command line of `argv` (as given to `ajet`), with `--resume` added when `resume` (and removed
    when not), quoted for a POSIX shell."""
    args = [a for a in argv if a != "--resume" and not a.startswith("trainer.resume=")]
    return shlex.join(["ajet", *args, *(["--resume"] if resume else [])])


def stopped_line(how: str, exp_dir: Path, total_steps: int, argv: list[str], server: bool = False) -> str:
    """The one line a training command (train, sft, serve, gateway; `server` for the last two) prints after it was
    stopped by `how` ("Ctrl-C", "SIGTERM"): the step reached (from `exp_dir/metrics.jsonl`: the last step logged),
    what is kept (the newest complete checkpoint, else what `ajet.run_folder.kept_work` keeps), and the command that
    continues (`argv` with --resume), e.g. "stopped by Ctrl-C at step 3 of 16; checkpoint of step 2 kept in
    experiments/x; continue with: ajet --conf x.yaml --resume". When nothing is kept (the folder would be moved
    aside: `ajet.run_folder.check_exp_dir`) it says that the same command starts afresh."""
    from ajet import checkpoint
    from ajet.run_folder import kept_work

    done = _last_logged_step(exp_dir / "metrics.jsonl")
    where = (f"after step {done} of {total_steps}" if done >= total_steps
             else f"at step {done + 1} of {total_steps}")
    newest = checkpoint.complete(exp_dir)
    if newest:
        step = newest[-1][0]
        return (f"stopped by {how} {where}; checkpoint of step {step} kept in {exp_dir}; continue with: "
                f"{continue_command(argv, True)}")
    kept = kept_work(exp_dir, server)
    if kept:
        return (f"stopped by {how} {where}; no checkpoint yet (trainer.save_freq), and {exp_dir} holds {kept}: "
                f"continue from step 1 with: {continue_command(argv, True)}")
    return (f"stopped by {how} {where}; nothing trained to keep: the same command starts afresh: "
            f"{continue_command(argv, False)}")


def _last_logged_step(path: Path) -> int:
    """The highest step of a metrics.jsonl (0 when missing, empty or unreadable)."""
    import json

    last = 0
    with contextlib.suppress(OSError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    last = max(last, row["step"])
    return last
