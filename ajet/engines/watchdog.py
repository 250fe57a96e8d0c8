"""The watchdog between ajet and a server it starts: the server never outlives ajet, `kill -9` of ajet included.

Run as a script (standard library only, so it starts in milliseconds), as the leader of a new process group:

    python -I watchdog.py OWNER_FD GRACE_S -- COMMAND...

It starts COMMAND as its child in its own process group (the server's own children, e.g. vLLM's engine core and
workers, stay in that group), then waits for either:

- end of file on OWNER_FD, the read end of a pipe whose only write end is held by the owner (ajet): the owner
  closed it (a normal stop) or the owner's process ended in any way, SIGKILL included (the kernel closes its
  descriptors). The watchdog sends SIGTERM to COMMAND (a graceful shutdown), waits up to GRACE_S seconds for it to
  exit, then SIGKILLs the whole group, itself included;
- COMMAND exiting on its own: it writes `[ajet watchdog] ... exited with code N` to its output (the server's log,
  where ajet reads the reason for a failed start, and `exit_code` reads N back: the exit status of a job of
  `ajet serve`, ajet/serve/jobs.py) and SIGKILLs what is left of the group.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys

_EXITED = re.compile(r"\[ajet watchdog\] .* exited with code (-?\d+)$", re.MULTILINE)


def main(argv: list[str]) -> None:
    """`argv`: OWNER_FD GRACE_S -- COMMAND... (see the module docstring). Never returns normally: it ends by
    SIGKILLing its own process group."""
    owner_fd, grace_s = int(argv[0]), float(argv[1])
    command = argv[argv.index("--") + 1:]
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)   # stdout/stderr: the watchdog's (the log)
    poller = select.poll()
    poller.register(owner_fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    owner_gone = False
    while server.poll() is None:
        if poller.poll(500) and not os.read(owner_fd, 4096):      # EOF: the owner closed the pipe, or died
            owner_gone = True
            break
    if owner_gone:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(grace_s)
        except subprocess.TimeoutExpired:
            print(f"[ajet watchdog] the server did not stop within {grace_s:g} s of SIGTERM: SIGKILL", flush=True)
    else:
        print(f"[ajet watchdog] {command[0]} exited with code {server.returncode}", flush=True)
    sys.stdout.flush()
    os.killpg(0, signal.SIGKILL)       # the server's children that outlived it, and this watchdog


def exit_code(output: str) -> int | None:
    """The exit status of COMMAND that ended on its own, read from the watchdog's output (`output`: the text of its
    log, or its tail): the code of the last `[ajet watchdog] ... exited with code N` line (negative: the signal that
    ended it), None when there is no such line (COMMAND was stopped because the owner was gone, or still runs). The
    watchdog's own exit status says nothing: it always ends by SIGKILLing its group."""
    codes = _EXITED.findall(output)
    return int(codes[-1]) if codes else None


if __name__ == "__main__":
    main(sys.argv[1:])
