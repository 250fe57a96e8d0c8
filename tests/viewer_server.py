"""Start a real `ajet view` process on 127.0.0.1 for the viewer tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from tests.local_servers import free_port


@contextlib.contextmanager
def running_viewer(exp_dir: Path, timeout_s: float = 90) -> Iterator[str]:
    """`python -m ajet view EXP_DIR --port P` as a subprocess; yields its base URL once /api/run answers,
    and stops it (terminate, then kill) on exit."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ajet", "view", str(exp_dir), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"ajet view exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                if httpx.get(base + "/api/run", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"ajet view did not answer on {base} within {timeout_s} s")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
