"""`ajet gateway` swaps weights under load: requests and streams in flight while the gateway trains its steps
all succeed, each records the policy version that produced it, every completion is sampled by one version (the
gateway serves while it trains: a switch lets the rows in flight finish on the version they started with), and
every request sent after a swap is answered by the new policy.

`ajet gateway` runs in a subprocess on the tiny model (the debug engine and the one training loop, as shipped);
client threads keep requests (half of them streamed) in flight the whole time while the test rates sessions,
which trains steps."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import httpx

from tests.test_gateway import SECRET, Gateway, _conf

STEPS = 4


def _client_loop(url: str, worker: int, stop: threading.Event, results: list, healthz) -> None:
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {SECRET}"}, timeout=120)
    k = 0
    while not stop.is_set():
        k += 1
        stream = k % 2 == 0
        body = {"model": "ajet-policy", "stream": stream, "max_tokens": 40,
                "messages": [{"role": "user", "content": f"Worker {worker} asks question {k}: count to ten."}]}
        sent_after = healthz()                       # the version served before this request was sent
        rec = {"stream": stream, "sent_after": sent_after}
        try:
            if stream:
                with http.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"X-Ajet-Session": f"w{worker}-{k}"}) as r:
                    rec["status"] = r.status_code
                    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                    rec["done"] = bool(lines) and lines[-1] == "data: [DONE]"
                    rec["errors"] = [line for line in lines if '"error"' in line]
                    rec["id"] = r.headers.get("x-ajet-response-id")
            else:
                r = http.post("/v1/chat/completions", json=body, headers={"X-Ajet-Session": f"w{worker}-{k}"})
                rec["status"], rec["done"], rec["errors"] = r.status_code, r.status_code == 200, []
                rec["id"], rec["header_version"] = r.headers.get("x-ajet-response-id"), r.headers.get(
                    "x-ajet-policy-version")
        except Exception as exc:  # noqa: BLE001 - a failure is what the test counts
            rec["status"], rec["done"], rec["errors"] = None, False, [repr(exc)]
        rec["session"] = f"w{worker}-{k}"
        results.append(rec)


def test_requests_and_streams_in_flight_across_weight_swaps(tmp_path, tiny_model_dir):
    conf, exp = _conf(tmp_path, tiny_model_dir, steps=STEPS + 1), tmp_path / "exp"   # still serving after STEPS
    conf.write_text(conf.read_text().replace("max_tokens: 6", "max_tokens: 40"))
    g = Gateway(conf, exp)
    stop, results = threading.Event(), []
    version = lambda: g.http.get("/healthz").json()["policy_version"]   # noqa: E731
    workers = [threading.Thread(target=_client_loop, args=(g.url, w, stop, results, version), daemon=True)
               for w in range(4)]
    try:
        for w in workers:
            w.start()
        for step in range(1, STEPS + 1):
            for reward in (1.0, 0.0):                # two rated, closed sessions: one step's group
                _, h = g.chat(f"Step {step}: what is {step} plus {reward}?")
                sid = h["x-ajet-session"]
                assert g.http.post("/v1/feedback", json={"session_id": sid, "reward": reward}).status_code == 200
                assert g.http.post(f"/v1/sessions/{sid}/close").status_code == 200
            g.wait_for(lambda: version() >= step)
            time.sleep(0.3)                          # let a few requests of the new policy finish
        n_after = len(results)
        g.wait_for(lambda: len(results) >= n_after + 3)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=120)
        g.stop()
    failed = [r for r in results if not (r["status"] == 200 and r["done"] and not r["errors"])]
    assert not failed, failed[:5]
    assert len(results) >= 20, len(results)
    with sqlite3.connect(exp / "gateway.sqlite") as db:
        recorded = dict(db.execute("SELECT response_id, policy_version FROM responses"))
        calls = [json.loads(r[0]) for r in db.execute("SELECT record FROM calls")]
    for r in results:                                # each records its version; none older than when it was sent
        assert r["id"] in recorded, r
        assert recorded[r["id"]] >= r["sent_after"], (r, recorded[r["id"]])
        if "header_version" in r:
            assert int(r["header_version"]) == recorded[r["id"]], r
    assert {recorded[r["id"]] for r in results} >= {0, STEPS}, "no request of the first or of the last policy"
    mixed = [c for c in calls if c["token_versions"] and len(set(c["token_versions"])) > 1]
    assert not mixed, "a completion was cut in two by a weight switch"
    assert all(recorded[r["id"]] == STEPS for r in results[n_after:])   # after the last swap: the new version
