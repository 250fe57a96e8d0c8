"""`ajet view` against odd requests, on a real `ajet view` process on 127.0.0.1: an integer parameter outside
SQLite's 64-bit range (or below 0) is a 400 naming it and its range on a connection that stays open, and a
request for another Host (a DNS-rebinding page) is refused with a 403."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from ajet.trajectory_store import TrajectoryStore
from ajet.viewer.app import create_app
from tests.local_servers import serving
from tests.viewer_server import running_viewer

I64_MAX = 9223372036854775807   # SQLite's INTEGER is a signed 64-bit int


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    """An experiment folder with one stored episode (step 1) of one call."""
    d = tmp_path_factory.mktemp("viewer_hardening")
    store = TrajectoryStore(d / "trajectories.sqlite")
    try:
        store.add_episode(step=1, attempt=0, record={
            "episode_id": "e1", "task": {"task_id": "t1", "query": "1+1?", "answer": "2"}, "group_id": "1:t1",
            "repeat_index": 0, "reward": 1.0, "error": None, "calls": []})
    finally:
        store.close()
    return d


@pytest.fixture(scope="module")
def base(exp):
    with running_viewer(exp) as url:
        yield url


def _exchange(sock: socket.socket, path: str, host: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 GET on an open (keep-alive) socket: (status, lower-cased headers, body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"the viewer closed the connection instead of answering GET {path}"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n = int(headers["content-length"])
    while len(body) < n:
        chunk = sock.recv(65536)
        assert chunk, f"the viewer closed the connection in the middle of the answer to GET {path}"
        body += chunk
    return status, headers, body[:n]


def test_integers_outside_their_range_are_a_400_naming_the_parameter_on_a_kept_connection(base):
    port = int(base.rsplit(":", 1)[1])
    huge, below = "99999999999999999999", "-99999999999999999999"
    cases = []   # (path, the parameter the message must name, its range)
    for value in (huge, below, str(I64_MAX + 1), "-1"):
        for path, name in ((f"/api/episodes?step={value}", "step"), (f"/api/episodes?offset={value}", "offset"),
                           (f"/api/episodes?step=1&attempt={value}", "attempt"), (f"/api/groups?step={value}", "step"),
                           (f"/api/groups?step=1&attempt={value}", "attempt"),
                           (f"/api/episode/e1?attempt={value}", "attempt"),
                           (f"/api/episode/e1/sample/0?attempt={value}", "attempt")):
            cases.append((path, f"`{name}`", f"0..{I64_MAX}"))
        cases.append((f"/api/episodes?limit={value}", "`limit`", "1..500"))
    cases.append(("/api/episode/e1/sample/" + huge, "sample index", f"0..{I64_MAX}"))
    cases.append(("/api/episodes?step=" + "9" * 5000, "`step`", f"0..{I64_MAX}"))   # past int()'s digit limit
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        for path, name, allowed in cases:
            status, headers, body = _exchange(sock, path)
            assert status == 400, (path, status, body[:300])
            message = json.loads(body)["error"]
            assert name in message and allowed in message, (path, message)
            assert headers.get("connection", "").lower() != "close", (path, headers)
        # the same connection still answers, and the largest value SQLite holds is a valid (empty) query
        status, _, body = _exchange(sock, f"/api/episodes?step={I64_MAX}&offset={I64_MAX}")
        assert status == 200 and json.loads(body)["total"] == 0
        status, _, body = _exchange(sock, "/api/episodes?step=1")
        assert status == 200 and [e["episode_id"] for e in json.loads(body)["episodes"]] == ["e1"]


def test_a_request_for_another_host_is_refused(base):
    """DNS rebinding: a page on rebind.example whose name now resolves to 127.0.0.1 still sends its own Host."""
    port = base.rsplit(":", 1)[1]
    for host in ("rebind.example", f"rebind.example:{port}", "127.0.0.1.rebind.example", "localhost.example:80",
                 "10.0.0.1", "[::2]"):
        for path in ("/api/run", "/api/episodes?step=1", "/", "/static/app.js"):
            r = httpx.get(base + path, headers={"Host": host}, timeout=30)
            assert r.status_code == 403, (host, path, r.status_code)
            assert "Host header" in r.json()["error"] and "localhost" in r.json()["error"]
            assert "e1" not in r.text
    for host in ("localhost", f"localhost:{port}", "LOCALHOST:9000", "127.0.0.1", f"127.0.0.1:{port}",
                 "[::1]", f"[::1]:{port}", "localhost."):
        r = httpx.get(base + "/api/episodes?step=1", headers={"Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text[:300])
    # no Host at all (HTTP/1.0): refused too
    with socket.create_connection(("127.0.0.1", int(port)), timeout=60) as sock:
        sock.sendall(b"GET /api/run HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 403"), reply[:200]


def test_the_host_the_viewer_was_started_on_is_accepted(exp):
    with serving(create_app(exp, host="viewer.lan")) as url:
        assert httpx.get(url + "/api/run", headers={"Host": "viewer.lan:8420"}, timeout=30).status_code == 200
        assert httpx.get(url + "/api/run", headers={"Host": "localhost"}, timeout=30).status_code == 200
        assert httpx.get(url + "/api/run", headers={"Host": "other.lan"}, timeout=30).status_code == 403
    with serving(create_app(exp, host="::1")) as url:   # an IPv6 address: its Host header is in brackets
        assert httpx.get(url + "/api/run", headers={"Host": "[::1]:8420"}, timeout=30).status_code == 200
    with serving(create_app(exp, host="0.0.0.0")) as url:   # every address: browse it as localhost or by a name
        assert httpx.get(url + "/api/run", headers={"Host": "0.0.0.0"}, timeout=30).status_code == 403
