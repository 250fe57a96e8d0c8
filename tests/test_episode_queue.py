"""The episode queue's hand-out rules, without a server: GRPO-group order, groups never mixing datasets,
an abandoned place handed out again, a client's own group, adoption after a restart, checkpointed state."""

import json
import textwrap
import threading
import time
from dataclasses import dataclass

import pytest

from ajet.rollout.episode_queue import EpisodeApiError, EpisodeQueue
from ajet.task import Task
from ajet.task_sampler import MultiTaskSampler


@dataclass
class _Endpoint:
    episode_id: str
    base_url: str
    api_key: str


class _Engine:
    policy_version = 0


class FakeProxy:
    """Opens and closes endpoints like `ProxyServer`, recording no calls."""

    model_name = "ajet-policy"
    engine = _Engine()

    def open_episode(self, eid):
        return _Endpoint(eid, f"http://x/ep/tok-{eid}/v1", f"tok-{eid}")

    def close_episode(self, endpoint):
        return []


def _queue(datasets=None, idle_timeout_s=300.0, stored=None, tasks_per_step=2, first_step=1, attempt=0):
    datasets = datasets or {"train": [Task(f"t{i}", f"q{i}") for i in range(6)]}
    stored = [] if stored is None else stored
    q = EpisodeQueue(MultiTaskSampler(datasets, None, False, 0), num_repeat=2, tasks_per_step=tasks_per_step,
                     total_steps=3, first_step=first_step, attempt=attempt,
                     record=lambda step, ep: stored.append((step, ep)), idle_timeout_s=idle_timeout_s)
    q.bind(FakeProxy())
    return q, stored


def test_places_are_handed_out_in_group_order_and_collected_oldest_first():
    q, stored = _queue()
    begun = [q.begin("c") for _ in range(4)]
    assert [(b["group_id"], b["episode_id"]) for b in begun] == [
        ("g0:t0", "a0-g0-r0"), ("g0:t0", "a0-g0-r1"), ("g1:t1", "a0-g1-r0"), ("g1:t1", "a0-g1-r1")]
    for b in reversed(begun):
        q.finish(b["episode_id"], reward=1.0)
    episodes = q.collect(1)
    assert [(e.group_id, e.repeat_index) for e in episodes] == [("g0:t0", 0), ("g0:t0", 1), ("g1:t1", 0), ("g1:t1", 1)]
    assert [s for s, _ in stored] == [1] * 4
    with pytest.raises(EpisodeApiError) as e:
        q.finish(begun[0]["episode_id"], reward=1.0)
    assert e.value.status == 409


def test_an_idle_episode_is_abandoned_and_its_place_handed_out_again():
    q, stored = _queue(idle_timeout_s=0.2)
    a = q.begin("dies")
    time.sleep(0.3)
    b = q.begin("lives")                      # reaps `a`, then hands out its place again
    assert b["group_id"] == a["group_id"] and b["episode_id"] == "a0-g0-r0-h2"
    q.flush()                                 # `a` is stored after `b` has its answer
    assert stored[0][1].episode_id == a["episode_id"] and stored[0][1].error.startswith("abandoned: no call")
    with pytest.raises(EpisodeApiError) as e:
        q.finish(a["episode_id"], reward=1.0)
    assert (e.value.status, e.value.code) == (410, "episode_abandoned")
    q.activity(b["api_key"], +1)              # a call in flight: never idle, however long it takes
    time.sleep(0.3)
    q.begin("other")
    assert q.status()["episodes"]["abandoned"] == 1


def test_datasets_never_mix_within_a_group_and_clients_choose_theirs():
    q, _ = _queue({"math": [Task("math/m0", "1+1")], "code": [Task("code/c0", "print")]})
    m = [q.begin("m", dataset="math") for _ in range(2)]
    c = [q.begin("c", dataset="code") for _ in range(2)]
    assert {b["group_id"] for b in m} == {"g0:math/m0"} and {b["dataset"] for b in m} == {"math"}
    assert {b["group_id"] for b in c} == {"g0:code/c0"} and c[0]["episode_id"] == "a0-code-g0-r0"
    with pytest.raises(EpisodeApiError) as e:
        q.begin("x", dataset="poetry")
    assert e.value.code == "unknown_dataset" and "code, math" in e.value.message


def test_own_groups_and_bad_finishes():
    q, _ = _queue()
    a = q.begin("c", task={"task_id": "mine", "query": "2+2", "answer": "4", "metadata": {}}, group_id="G")
    q.begin("c", group_id="G")
    with pytest.raises(EpisodeApiError) as e:
        q.begin("c", group_id="G")
    assert e.value.code == "group_full"
    with pytest.raises(EpisodeApiError) as e:
        q.finish(a["episode_id"], reward=float("nan"))
    assert e.value.code == "invalid_reward"
    with pytest.raises(EpisodeApiError) as e:
        q.finish(a["episode_id"])             # no reward, no judge: refused, the episode goes on running
    assert e.value.code == "missing_reward"
    assert q.finish(a["episode_id"], reward=0.0)["status"] == "finished"
    with pytest.raises(EpisodeApiError) as e:
        q.finish("nope", reward=1.0)
    assert e.value.status == 404


def test_a_restarted_queue_reopens_groups_and_adopts_finished_episodes():
    q, stored = _queue()
    first = [q.begin("c") for _ in range(3)]  # g0-r0, g0-r1, g1-r0
    q.finish(first[1]["episode_id"], reward=0.5)
    q.finish(first[2]["episode_id"], reward=0.25)
    state = q.state_dict(0)
    records = [{**ep.to_dict(), "attempt": 0} for _, ep in stored]

    q2, stored2 = _queue(attempt=1)
    q2.load_state_dict(state)
    q2.adopt(records)
    b = [q2.begin("c") for _ in range(2)]
    assert [x["episode_id"] for x in b] == ["a1-g0-r0", "a1-g1-r1"]   # only the places nobody finished
    for x in b:
        q2.finish(x["episode_id"], reward=1.0)
    episodes = q2.collect(1)
    assert [(e.episode_id, e.attempt, e.reward, e.repeat_index) for e in episodes] == [   # adopted: their own places
        ("a1-g0-r0", 1, 1.0, 0), ("a0-g0-r1", 0, 0.5, 1), ("a0-g1-r0", 0, 0.25, 0), ("a1-g1-r1", 1, 1.0, 1)]
    assert q2.counts["adopted"] == 2 and len(stored2) == 2    # adopted episodes are not stored twice


def test_collect_waits_for_complete_groups_while_clients_finish_in_threads():
    q, _ = _queue(tasks_per_step=1)
    got = []
    t = threading.Thread(target=lambda: got.append(q.collect(1)))
    t.start()
    a, b = q.begin("c"), q.begin("c")
    q.finish(a["episode_id"], reward=1.0)
    time.sleep(0.2)
    assert not got                            # one place of the group is still running
    q.finish(b["episode_id"], error="tool crashed")
    t.join(5)
    (eps,) = got
    assert [e.ok for e in eps] == [True, False] and "tool crashed" in eps[1].error


def test_multi_task_config_and_reproducible_mix(tmp_path):
    from ajet.config import load_config
    from ajet.errors import ConfigError
    from ajet.tasks import read_datasets

    for name in ("math", "code"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"query": f"{name} {i}"}) + "\n" for i in range(3)))
    conf = tmp_path / "conf.yaml"
    conf.write_text(textwrap.dedent("""
        workflow: wf.py:W
        data: {train: [{name: math, path: math.jsonl, weight: 3}, {name: code, path: code.jsonl}]}
    """))
    datasets = read_datasets(load_config(conf))
    assert [t.task_id for t in datasets["code"]] == ["code/code-0", "code/code-1", "code/code-2"]
    assert datasets["math"][0].metadata == {"dataset": "math"}
    draws = [MultiTaskSampler(datasets, {"math": 3, "code": 1}, True, 7).next_batch(40) for _ in range(2)]
    assert draws[0] == draws[1]                                   # the mix is reproducible
    assert 20 < sum(t.metadata["dataset"] == "math" for t in draws[0]) < 40
    conf.write_text("workflow: wf.py:W\ndata: {train_path: math.jsonl, train: [{name: a, path: math.jsonl}]}\n")
    with pytest.raises(ConfigError, match="name exactly one task source"):
        load_config(conf)


def test_two_reapers_at_once_never_raise_out_of_unrelated_calls():
    """Two `begin`s (and the trainer's `collect`) reap the same idle episodes at once, while storing an
    abandoned episode is slow: each idle episode is abandoned and stored exactly once, and nobody gets a
    404 for an episode it never named."""
    stored = []

    def slow_record(step, ep):
        time.sleep(0.05)                      # a slow disk: the window in which a second reaper runs
        stored.append(ep.episode_id)

    q, _ = _queue(idle_timeout_s=0.05)
    q.record = slow_record
    idle = [q.begin("dies")["episode_id"] for _ in range(8)]   # every place of the 4 open groups
    time.sleep(0.1)
    errors, got, go = [], [], threading.Barrier(3)

    def call(fn):
        go.wait()
        try:
            got.append(fn())
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=call, args=(lambda: q.begin("lives"),)) for _ in range(2)]
    threads.append(threading.Thread(target=call, args=(lambda: q.collect(1),), daemon=True))
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join(60)
    deadline = time.monotonic() + 60          # collect's own reaping pass stores in its thread (8 x 0.05 s):
    while not set(idle) <= set(stored) and time.monotonic() < deadline:   # wait for it, bounded, not 0.6 s
        time.sleep(0.05)
    q.flush()
    assert errors == []
    assert len(got) == 2 and {g["group_id"] for g in got} == {"g0:t0"}
    assert len(stored) == len(set(stored))                      # stored once each ...
    assert sorted(e for e in stored if e in idle) == sorted(idle)  # ... every idle one (and later the two new ones)


def test_begin_answers_before_the_episodes_it_reaped_are_stored():
    """Under load, a begin that first stored every idle episode it reaped answered so late that the episode
    it handed out idled out in turn (serve_load: 1,187 episodes abandoned in a cascade). The client gets
    its answer while the store is still busy with the reaped ones."""
    release, stored = threading.Event(), []

    def blocked_record(step, ep):
        release.wait(30)                      # a store that is slow for as long as the test likes
        stored.append(ep.episode_id)

    q, _ = _queue(idle_timeout_s=0.05)
    q.record = blocked_record
    idle = [q.begin("dies")["episode_id"] for _ in range(2)]
    time.sleep(0.1)
    got = []
    t = threading.Thread(target=lambda: got.append(q.begin("lives")), daemon=True)
    t.start()
    t.join(10)
    assert got and got[0]["episode_id"] == "a0-g0-r0-h3" and stored == []   # answered; nothing stored yet
    release.set()
    q.flush()
    assert stored == idle
