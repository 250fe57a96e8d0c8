"""A sandboxed run cancelled by its caller (a tool call past its episode's timeout, a rollout shutting down) is
killed and reaped before the cancellation returns: its subprocess transport is closed on the caller's loop, so a
loop closed right after leaves no "RuntimeError: Event loop is closed", no unclosed-transport warning and no
process behind. A real child process under the real launcher (isolation "none": it runs everywhere)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import warnings

from ajet.tools.sandbox import run_python_async

RUNS = 3


def _cancel_once(tmp_path, i: int) -> tuple[bool, int]:
    """Start a sandboxed program, cancel the run once it is running, close the loop at once. Returns whether the
    run ended cancelled, and the pid of the program's launcher."""
    started = tmp_path / f"started-{i}"
    code = f"import os, time\nopen({str(started)!r}, 'w').write(str(os.getppid()))\ntime.sleep(120)\n"
    loop = asyncio.new_event_loop()

    async def main() -> bool:
        run = asyncio.ensure_future(run_python_async(code, timeout_s=300, isolation="none"))
        for _ in range(6000):                           # up to a minute for the program to start
            if started.exists() and started.read_text():
                break
            await asyncio.sleep(0.01)
        assert started.exists(), "the sandboxed program did not start"
        run.cancel()
        try:
            await run
        except asyncio.CancelledError:
            return True
        return False

    try:
        cancelled = loop.run_until_complete(main())
    finally:
        loop.close()
    return cancelled, int(started.read_text())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_cancelled_run_is_reaped_before_its_loop_closes(tmp_path, monkeypatch):
    gc.collect()      # what earlier tests of this process left unclosed reports itself now, not in this test's record
    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for i in range(RUNS):
            cancelled, launcher = _cancel_once(tmp_path, i)
            assert cancelled
            assert _gone(launcher), f"the launcher {launcher} was not reaped when the cancellation returned"
            gc.collect()                                # an unclosed transport reports itself here
    assert not unraisable, unraisable[:3]
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks[:3]
