"""Ctrl-C on `ajet serve` while a client keeps starting model calls that stay in flight (their bodies still being
uploaded) and another client's episode is open: the server stops within seconds, without waiting to tell its
clients, says so in one line on stderr (no traceback) and exits 130; a call in flight is answered 503
`server_stopping` instead of a dropped connection. A real `ajet serve` subprocess with the tiny model, its stdout
and stderr written to files, and real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from urllib.parse import urlsplit

import httpx

from ajet.serve import LINGER_S

SECRET = "test-secret-0123456789abcdef"


def _wait_for(path, pattern: str, proc: subprocess.Popen, timeout_s: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while not (m := re.search(pattern, path.read_text())):
        assert proc.poll() is None and time.monotonic() < deadline, path.read_text()[-3000:]
        time.sleep(0.1)
    return m


def _stalled_call(base_url: str) -> socket.socket:
    """A model call whose body stops after 10 of its 1000 bytes (the connection stays open)."""
    u = urlsplit(base_url + "/chat/completions")
    sock = socket.create_connection((u.hostname, u.port), timeout=120)
    sock.sendall(f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 1000\r\n\r\n{{\"model\": ".encode())
    return sock


def _keep_calling(base_url: str, proc: subprocess.Popen, sockets: list[socket.socket]) -> None:
    """Start another stalled call every 0.5 s until the server is gone (at most 10 minutes of them)."""
    for _ in range(1200):
        time.sleep(0.5)
        if proc.poll() is not None:
            return
        try:
            sockets.append(_stalled_call(base_url))
        except OSError:                 # the server closed its port
            return


def test_ctrl_c_stops_ajet_serve_in_seconds_with_one_line(tiny_model_dir, tmp_path):
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"What is {i} plus 1?",
                                                              "answer": str(i + 1)}) + "\n" for i in range(8)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 4}}
        trainer: {{total_steps: 50, tasks_per_step: 2, tensorboard: false}}
        serve: {{episode_idle_timeout_s: 600}}
    """))
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "ajet", "serve", "--conf", "conf.yaml", "--exp-dir", "exp",
                                 "--port", "0"], stdout=o, stderr=e, cwd=tmp_path,
                                env={**os.environ, "AJET_SECRET": SECRET})
    try:
        url = _wait_for(out, r"proxy on (http://\S+)", proc).group(1)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {SECRET}"}, timeout=60) as http:
            calling, idle = (http.post("/ajet/v1/episodes", json={"client_id": c}).json() for c in ("calling", "idle"))
        assert idle["episode_id"] != calling["episode_id"]
        sockets = [_stalled_call(calling["base_url"])]
        sending = threading.Thread(target=_keep_calling, args=(calling["base_url"], proc, sockets), daemon=True)
        sending.start()                 # a client heard from all the time, its calls in flight: never told
        time.sleep(1.0)
        sigint_at = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
        took_s = time.monotonic() - sigint_at
        sending.join(60)
        answer = b""
        while part := sockets[0].recv(65536):
            answer += part
    finally:
        if proc.poll() is None:
            proc.kill()
        for sock in sockets if "sockets" in locals() else []:
            sock.close()
    stderr = err.read_text()
    assert rc == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    said = [line for line in stderr.splitlines() if "Ctrl-C" in line]
    assert len(said) == 1 and "--resume" in said[0], stderr[-3000:]
    assert answer.startswith(b"HTTP/1.1 503") and b"server_stopping" in answer, answer[:500]
    # it waited for no client: the clients' lingering (LINGER_S) never began
    assert took_s < LINGER_S / 2, (took_s, stderr[-2000:])
