"""`ajet view` on a real experiment folder (a 2-step tiny-model run): the JSON API, served by the real
`ajet view` process on 127.0.0.1, against what the run wrote to trajectories.sqlite."""

import json
import shutil
import sqlite3

import httpx
import pytest

from ajet.trajectory_store import TrajectoryStore
from ajet.viewer.run_reader import RunReader
from tests.viewer_server import running_viewer


@pytest.fixture(scope="module")
def exp(tiny_experiment, tmp_path_factory):
    """A copy of the session's experiment folder (the live-write test appends to it)."""
    dst = tmp_path_factory.mktemp("viewer_api") / "exp"
    shutil.copytree(tiny_experiment, dst, ignore=shutil.ignore_patterns("checkpoints"))
    return dst


@pytest.fixture(scope="module")
def base(exp):
    with running_viewer(exp) as url:
        yield url


def get(base, path, status=200):
    r = httpx.get(base + path, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def stored(exp, sql, *args):
    db = sqlite3.connect(exp / "trajectories.sqlite")
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def test_overview_has_every_step_and_the_charted_metrics(base):
    run = get(base, "/api/run")
    assert [s["step"] for s in run["steps"]] == [1, 2]
    assert [s["episodes"] for s in run["steps"]] == [6, 6]
    assert run["steps"][0]["failed"] == 3 and run["steps"][1]["failed"] == 0   # step 1 ran the failing task
    # step 0: the held-out evaluation before training (the tiny experiment runs with val_freq)
    assert [m["step"] for m in run["metrics"]] == [0, 1, 2]
    for key in ("reward/mean", "tracker/merge_ratio", "tracker/token_ratio", "train/clip_frac", "time/step_s",
                "workflow/turns", "rollout/zero_std_groups", "guards/empty_loss_samples",
                "guards/out_of_vocab_token_episodes", "guards/non_finite_logprob_episodes", "guards/max_policy_lag"):
        assert key in run["chart_keys"]
    assert run["policy_version"] == 2 and run["has_samples_table"]


def test_episode_list_matches_the_store_with_filters_order_and_paging(base, exp):
    page = get(base, "/api/episodes?step=1")
    assert page["total"] == 6
    want = {r[0]: (r[1], r[2]) for r in stored(exp, "SELECT episode_id, reward, error FROM episodes WHERE step = 1")}
    adv = {r[0]: r[1] for r in stored(exp, "SELECT episode_id, advantage FROM samples WHERE step = 1")}
    for e in page["episodes"]:
        reward, error = want[e["episode_id"]]
        assert e["reward"] == reward and e["advantage"] == adv.get(e["episode_id"])
        assert e["failure"] == ("RuntimeError: the lookup service is down" if error else None)
        assert e["calls"] == (1 if error else 2) and e["samples"] == (0 if error else 1)
        assert e["agent_tags"] == ["default"]
    # group order keeps each GRPO group together
    groups = [e["group_id"] for e in page["episodes"]]
    assert groups == sorted(groups)

    failed = get(base, "/api/episodes?step=1&failed=1")
    assert failed["total"] == 3 and all(e["failure"] for e in failed["episodes"])
    assert get(base, "/api/episodes?step=1&failed=0")["total"] == 3
    best = [e["advantage"] for e in get(base, "/api/episodes?step=2&order=advantage_desc")["episodes"]]
    assert best == sorted(best, reverse=True) and len(best) == 6
    worst = [e["advantage"] for e in get(base, "/api/episodes?step=2&order=advantage_asc")["episodes"]]
    assert worst == sorted(worst)
    assert get(base, "/api/episodes?q=LOOKUP%20SERVICE%20is%20down")["total"] == 3   # text search, every step
    assert get(base, "/api/episodes?q=tool%20result%2042&step=2")["total"] == 6       # tool results are searched
    assert get(base, "/api/episodes?step=1&agent=default")["total"] == 6
    assert get(base, "/api/episodes?step=1&agent=planner")["total"] == 0
    assert get(base, "/api/episodes?step=1&fork=any")["total"] == 0              # two calls that merge: no fork
    one_group = get(base, f"/api/episodes?step=1&group={groups[-1]}")
    assert one_group["total"] == 3 and {e["group_id"] for e in one_group["episodes"]} == {groups[-1]}
    pages = [get(base, f"/api/episodes?step=1&limit=2&offset={o}")["episodes"] for o in (0, 2, 4)]
    assert [e["episode_id"] for p in pages for e in p] == [e["episode_id"] for e in page["episodes"]]

    groups_view = get(base, "/api/groups?step=1")
    assert sorted(g["episodes"] for g in groups_view) == [3, 3]
    assert sorted(g["failed"] for g in groups_view) == [0, 3]


def test_episode_shows_calls_tool_results_answer_and_samples(base, exp):
    (eid,) = stored(exp, "SELECT episode_id FROM episodes WHERE step = 2 ORDER BY rowid LIMIT 1")[0]
    record = json.loads(stored(exp, "SELECT record FROM episodes WHERE episode_id = ?", eid)[0][0])
    ep = get(base, f"/api/episode/{eid}")
    assert ep["step"] == 2 and ep["attempt"] == 0 and ep["reward"] == record["reward"]
    assert ep["output"]["final_answer"] == record["output"]["final_answer"]
    assert [c["call_id"] for c in ep["calls"]] == [c["call_id"] for c in record["calls"]]
    c0, c1 = ep["calls"]
    assert "prompt_ids" not in c0 and c0["prompt_tokens"] == len(record["calls"][0]["prompt_ids"])
    assert c0["completion_tokens"] == len(record["calls"][0]["completion_ids"])
    assert c1["messages"][-1] == {"role": "tool", "tool_call_id": "call_0", "content": "TOOL RESULT 42"}
    assert c0["sampling"]["max_tokens"] == 12 and c0["timings"]["total_s"] > 0
    (s,) = ep["samples"]
    assert s["call_ids"] == [c0["call_id"], c1["call_id"]] and s["trained"] is True
    assert ep["samples_source"] == "store" and ep["trained_in"] == [[2, 0]]   # the store's trained-on ledger

    failed = get(base, "/api/episode/" + stored(exp, "SELECT episode_id FROM episodes WHERE error IS NOT NULL")[0][0])
    assert "the lookup service is down" in failed["error"] and failed["samples"] == [] and failed["trained_in"] == []


def test_sample_tokens_carry_the_stored_ids_masks_and_logprobs(base, exp):
    for eid, sample_json in stored(exp, "SELECT episode_id, record FROM samples ORDER BY step, episode_id"):
        want = json.loads(sample_json)
        calls = {json.loads(r[0])["call_id"]: json.loads(r[0]) for r in
                 stored(exp, "SELECT record FROM calls WHERE episode_id = ?", eid)}
        got = get(base, f"/api/episode/{eid}/sample/0")
        n = len(want["prompt_ids"])
        assert got["ids"] == want["prompt_ids"] + want["response_ids"]
        assert got["prompt_len"] == n
        assert got["loss_mask"] == [0] * n + want["loss_mask"]
        assert got["advantage"] == want["advantage"] and got["trained"] is True
        for i, m in enumerate(want["loss_mask"]):
            if m:
                assert got["logprobs"][n + i] == want["old_logprobs"][i]
        # every call's completion sits where the span says, with the engine's own logprobs
        assert [c["call_id"] for c in got["calls"]] == want["call_ids"]
        for span in got["calls"]:
            call = calls[span["call_id"]]
            a, b = span["completion_start"], span["completion_end"]
            assert span["exact"] and got["ids"][a:b] == call["completion_ids"]
            assert got["logprobs"][a:b] == call["completion_logprobs"]
            assert got["loss_mask"][a:b] == [1] * (b - a)
        # the tool result between the calls is text of untrained tokens
        between = range(got["calls"][0]["completion_end"], got["calls"][1]["completion_start"])
        assert "TOOL RESULT 42" in "".join(got["text"][i] for i in between)
        assert all(got["loss_mask"][i] == 0 and got["logprobs"][i] is None for i in between)
        assert got["tokenizer"] is None and len(got["text"]) == len(got["ids"]) == len(got["pieces"])


def test_bad_requests_are_4xx_with_a_message(base):
    assert "no episode" in get(base, "/api/episode/nope", 404)["error"]
    assert "no sample 5" in get(base, "/api/episode/" + get(base, "/api/episodes?step=2")["episodes"][0]["episode_id"]
                                + "/sample/5", 404)["error"]
    assert "order must be one of" in get(base, "/api/episodes?order=sideways", 400)["error"]
    assert "`step` must be an integer" in get(base, "/api/episodes?step=two", 400)["error"]
    assert "`step` is required" in get(base, "/api/groups", 400)["error"]
    assert httpx.get(base + "/plots/nothing.png").status_code == 404
    page = httpx.get(base + "/", timeout=30)
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert httpx.get(base + "/static/app.js").status_code == 200


def test_a_running_writer_is_seen_live_and_odd_records_are_tolerated(base, exp):
    """The viewer reads while a writer appends (WAL): a new episode shows up without a restart, and a
    record with an unknown field and without `duration_s`/`output`/samples still lists and opens."""
    store = TrajectoryStore(exp / "trajectories.sqlite")   # the writer, as the trainer holds it
    try:
        record = {"episode_id": "live-1", "task": {"task_id": "x", "query": "q?", "answer": "a"}, "group_id": "9:x",
                  "repeat_index": 0, "reward": 0.5, "error": None, "calls": [], "new_field_from_a_later_ajet": [1, 2]}
        store.add_episode(step=9, attempt=0, record=record)
        page = get(base, "/api/episodes?step=9")
        assert [e["episode_id"] for e in page["episodes"]] == ["live-1"]
        assert page["episodes"][0]["duration_s"] is None and page["episodes"][0]["samples"] == 0
        assert get(base, "/api/run")["steps"][-1]["step"] == 9
        ep = get(base, "/api/episode/live-1")
        assert ep["new_field_from_a_later_ajet"] == [1, 2] and ep["samples_source"] == "none"
    finally:
        store.close()


def test_a_store_without_the_samples_table_rebuilds_samples_from_the_calls(exp, tmp_path):
    """Older stores hold only the calls: the tracker merges them again (same tokens and masks; advantage
    unknown)."""
    shutil.copy(exp / "trajectories.sqlite", tmp_path / "trajectories.sqlite")
    shutil.copy(exp / "config.json", tmp_path / "config.json")
    db = sqlite3.connect(tmp_path / "trajectories.sqlite")
    db.execute("DROP TABLE samples")
    db.commit()
    db.close()
    eid, sample_json = stored(exp, "SELECT episode_id, record FROM samples ORDER BY step LIMIT 1")[0]
    want = json.loads(sample_json)
    got = RunReader(tmp_path).sample_tokens(eid, 0)
    assert got["samples_source"] == "rebuilt" and got["advantage"] is None
    assert got["ids"] == want["prompt_ids"] + want["response_ids"]
    assert got["loss_mask"][got["prompt_len"]:] == want["loss_mask"]
    assert RunReader(tmp_path).episodes(step=1)["episodes"][0]["advantage"] is None
