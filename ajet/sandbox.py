"""Run untrusted Python (a tool that executes model-written code) in a subprocess with limits.

The child is a fresh isolated interpreter (`python -I`) with an address-space cap (RLIMIT_AS), a CPU-time
cap (RLIMIT_CPU), no core dumps, and a wall-clock timeout after which it is killed. It shares nothing
with the training process but the file system.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class SandboxResult:
    """stdout/stderr text, exit code (None when killed on timeout), and whether the timeout hit."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, stdin: str = "") -> SandboxResult:
    """Execute `code` in a limited child interpreter.

    Args:
        code: Python source, run as `python -I -c code`.
        timeout_s: wall-clock limit, seconds (the CPU limit is the same, rounded up).
        memory_mb: address-space limit, MiB (allocations beyond it raise MemoryError in the child).
        stdin: text fed to the child's standard input.
    Returns:
        SandboxResult; never raises for anything the child does.
    """
    def limit() -> None:  # runs in the child before exec
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        cpu = int(timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    try:
        p = subprocess.run([sys.executable, "-I", "-c", code], input=stdin, capture_output=True, text=True,
                           timeout=timeout_s, preexec_fn=limit)
    except subprocess.TimeoutExpired as exc:
        return SandboxResult(_text(exc.stdout), _text(exc.stderr), None, True)
    return SandboxResult(p.stdout, p.stderr, p.returncode, False)


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
