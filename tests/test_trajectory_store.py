"""The trajectory store under `ajet serve`'s concurrency: HTTP worker threads commit finished episodes while
the trainer thread commits the step's samples, on one SQLite connection."""

import threading

from ajet.trajectory_store import TrajectoryStore


def _record(eid: str) -> dict:
    return {"episode_id": eid, "task": {"task_id": "t"}, "reward": 1.0, "error": None,
            "calls": [{"call_id": f"{eid}-c{i}", "index": i} for i in range(3)]}


def test_samples_committed_while_episodes_commit_from_other_threads_lose_nothing(tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    attempt = store.begin_attempt(0)
    errors, acknowledged = [], []
    start = threading.Barrier(5)

    def clients(k: int) -> None:               # an HTTP worker: finish -> committed -> "finished" to the client
        start.wait()
        for i in range(150):
            eid = f"c{k}-e{i}"
            try:
                store.add_episode(1, attempt, _record(eid))
                acknowledged.append(eid)
            except Exception as exc:  # noqa: BLE001 - what the server would have answered with a 500
                errors.append(repr(exc))

    def trainer() -> None:                     # the trainer thread: the step's samples, again and again
        start.wait()
        for step in range(150):
            try:
                store.add_samples(step, attempt, [{"episode_id": f"s{j}", "advantage": 0.5} for j in range(20)])
            except Exception as exc:  # noqa: BLE001 - a crashed trainer thread stops the server
                errors.append(repr(exc))

    threads = [threading.Thread(target=clients, args=(k,)) for k in range(4)] + [threading.Thread(target=trainer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stored = {r["episode_id"] for r in store.episodes()}
    assert len(acknowledged) == 600 and stored == set(acknowledged)    # every acknowledged episode is there
    assert store.count() == (600, 1800)
    store.close()
