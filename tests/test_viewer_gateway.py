"""`ajet view` of a gateway's folder: `GET /api/gateway` and the `#/gateway` page (versions served, gate
decisions, rollbacks, feedback over time), served by the real `ajet view` process on 127.0.0.1.

The folder is a copy of the tiny 2-step run (the viewer's trajectories.sqlite) plus a gateway.sqlite the test
writes through the gateway's own store (`GatewayStore`) with known rows: three versions served (start, a gated
update, a rollback), two gate decisions (one refused), four feedback rows at known times. Every expected value
is the test's own."""

from __future__ import annotations

import shutil
import statistics

import httpx
import pytest

from ajet.gateway.store import GatewayStore
from tests.test_viewer_browser import CHROMIUM, CHROMIUM_FLAGS, _playwright_missing
from tests.viewer_server import running_viewer

FEEDBACK = [("s1", 1.0, "client", 1000.0), ("s2", 0.0, "client", 1060.0), ("s3", 0.5, "judge", 1120.0),
            ("s4", 1.0, "client", 1800.0)]


@pytest.fixture(scope="module")
def gateway_dir(tiny_experiment, tmp_path_factory):
    exp = tmp_path_factory.mktemp("viewer_gateway") / "exp"
    shutil.copytree(tiny_experiment, exp, ignore=shutil.ignore_patterns("checkpoints"))
    store = GatewayStore(exp / "gateway.sqlite")
    for sid, reward, source, at in FEEDBACK:
        store.open_session(sid, f"query {sid}", "new", at=at - 10)
        store.close_session(sid, "idle", at=at - 5)
        store.add_feedback(sid, reward, f"comment {sid}", source, at=at)
    store.open_session("s5", "query s5", "new")                       # open, never rated
    store.add_version(0, 0, "start", 1.0)
    store.add_gate(1, 1, 0, "pass@1", 1.0, 0.5, 0.1, False, "pass@1 0.5 is 0.5 below the serving policy's 1")
    store.add_gate(2, 1, 0, "pass@1", 1.0, 0.95, 0.1, True, "served")
    store.add_version(1, 2, "gate", 0.95)
    rollback = store.request_rollback(0)
    store.finish_rollback(rollback, True, "version 0 is served (was 1)")
    store.add_version(0, 2, "rollback", 1.0)
    store.close()
    return exp


@pytest.fixture(scope="module")
def base(gateway_dir):
    with running_viewer(gateway_dir) as url:
        yield url


def test_the_gateway_api_has_versions_gate_results_and_feedback_over_time(base):
    assert httpx.get(base + "/api/run", timeout=60).json()["gateway"] is True
    g = httpx.get(base + "/api/gateway?windows=2", timeout=60).json()
    assert [(v["version"], v["how"], v["figure"]) for v in g["versions"]] == [(0, "start", 1.0), (1, "gate", 0.95),
                                                                             (0, "rollback", 1.0)]
    assert g["policy_version"] == 0
    assert [(d["step"], d["served"], d["serving_figure"], d["candidate_figure"]) for d in g["gate"]] == [
        (1, False, 1.0, 0.5), (2, True, 1.0, 0.95)]
    assert g["gate"][0]["reason"].startswith("pass@1 0.5 is 0.5 below")
    assert [(r["to_version"], r["ok"], r["message"]) for r in g["rollbacks"]] == [(0, 1, "version 0 is served (was 1)")]
    assert g["sessions"] == {"total": 5, "closed": 4, "dropped": 0, "rated": 4}
    f = g["feedback"]
    assert f["count"] == 4 and f["by_source"] == {"client": 3, "judge": 1}
    assert f["reward_mean"] == pytest.approx(statistics.fmean(r for _, r, _, _ in FEEDBACK))
    # two windows of 400 s from the first feedback (1000 s): three rows in the first, the last one in the second
    assert [(w["start"], w["end"], w["count"], w["client"], w["judge"]) for w in f["windows"]] == [
        (1000.0, 1400.0, 3, 2, 1), (1400.0, 1800.0, 1, 1, 0)]
    assert f["windows"][0]["reward_mean"] == pytest.approx(0.5) and f["windows"][1]["reward_mean"] == 1.0
    assert [(x["session_id"], x["comment"]) for x in f["recent"]] == [("s4", "comment s4"), ("s3", "comment s3"),
                                                                      ("s2", "comment s2"), ("s1", "comment s1")]


def test_bad_parameters_other_hosts_and_plain_runs(base, tiny_experiment):
    for bad in ("0", "501", "abc", "1.5"):
        r = httpx.get(base + f"/api/gateway?windows={bad}", timeout=60)
        assert r.status_code == 400 and "`windows`" in r.json()["error"], (bad, r.text)
    r = httpx.get(base + "/api/gateway", headers={"Host": "attacker.example"}, timeout=60)
    assert r.status_code == 403 and "Host header" in r.json()["error"]
    with running_viewer(tiny_experiment) as plain:            # an `ajet --conf` run: no gateway.sqlite
        assert httpx.get(plain + "/api/run", timeout=60).json()["gateway"] is False
        r = httpx.get(plain + "/api/gateway", timeout=60)
        assert r.status_code == 404 and "gateway.sqlite" in r.json()["error"]
    assert not (tiny_experiment / "gateway.sqlite").exists()  # the viewer never creates it


@pytest.mark.skipif(_playwright_missing() is not None, reason=_playwright_missing() or "")
def test_the_gateway_page_in_chromium(base):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page()
        page.set_default_timeout(60_000)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(base + "/")
        page.wait_for_selector("body[data-view=overview] #gateway-link")
        page.locator("#gateway-link").click()
        page.wait_for_selector("body[data-view=gateway] #versions")
        seen = {"versions": page.locator("#versions tr").count() - 1, "gate": page.locator("#gate tr").count() - 1,
                "refused": page.locator("#gate tr.refused").count(), "charts": page.locator("#feedback-charts svg polyline").count(),
                "feedback": page.locator("#feedback tr").count() - 1, "rollbacks": page.locator("#rollbacks tr").count() - 1,
                "refused_text": page.locator("#gate tr.refused").inner_text()}
        browser.close()
    assert errors == []
    assert (seen["versions"], seen["gate"], seen["refused"], seen["rollbacks"], seen["feedback"]) == (3, 2, 1, 1, 4)
    assert seen["charts"] == 2 and "refused" in seen["refused_text"] and "0.5" in seen["refused_text"]
