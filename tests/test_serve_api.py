"""The episode API on a real server on 127.0.0.1 (the real proxy and episode queue behind uvicorn, a scripted
engine instead of a model, so each test takes about a second): bad input on every route gets a JSON 4xx
naming the field and begins nothing; only the client that began an episode can end it; a stalled upload
does not keep its episode alive; clients wait for a server whose trainer stopped instead of exiting.
Where the queue's timing matters (idle episodes, clients heard from lately) it runs on a `ManualClock` that
only the test moves, so that the outcome does not depend on the machine's load."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from ajet.client import AjetClient, AsyncAjetClient, RunFinished
from ajet.llm_call import SamplingParams
from ajet.metrics_log import MetricsLogger
from ajet.proxy.server import ProxyServer
from ajet.rollout.episode_queue import EpisodeQueue
from ajet.serve.api import MAX_DEPTH, build_api, compose
from ajet.task import Task
from ajet.task_sampler import MultiTaskSampler
from tests.local_servers import free_port
from tests.manual_clock import ManualClock, waits_on
from tests.scripted_engine import ScriptedEngine

SECRET = "test-secret-0123456789abcdef"


@contextmanager
def served(tokenizer, idle_timeout_s: float = 300.0, port: int = 0, attempt: int = 0, total_steps: int = 3,
           clock=time.monotonic, engine=None, keys=()):
    """A started server: the proxy over a scripted engine (or `engine`) with the episode API mounted, as `ajet
    serve` composes them (with `keys` beside the secret: (name, key, scope) each), its queue on `clock`; yields
    (queue, httpx client with the secret, stored episodes)."""
    stored = []
    proxy = ProxyServer(engine or ScriptedEngine(tokenizer, ["7"]), tokenizer, SamplingParams(max_tokens=8))
    proxy.port = port
    queue = EpisodeQueue(MultiTaskSampler({"train": [Task(f"t{i}", f"What is {i} + 1?", str(i + 1)) for i in range(8)]}),
                         num_repeat=2, tasks_per_step=2, total_steps=total_steps, first_step=1, attempt=attempt,
                         record=lambda step, ep: stored.append(ep), idle_timeout_s=idle_timeout_s, clock=clock)
    queue.bind(proxy)
    proxy.app = compose(proxy.app, build_api(queue, SECRET, list(keys)), queue.activity)
    proxy.start()
    http = httpx.Client(base_url=proxy.url, headers={"Authorization": f"Bearer {SECRET}"}, timeout=30)
    try:
        yield queue, http, stored
    finally:
        http.close()
        proxy.stop()


def _nested(depth: int):
    v: dict = {}
    for _ in range(depth):
        v = {"a": v}
    return v


def _begin_in_thread(client: AjetClient):
    """`client.begin()` in a thread; returns (thread, [the episode once begun], [the exception it raised])."""
    got, errors = [], []

    def begin():
        try:
            got.append(client.begin())
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=begin)
    thread.start()
    return thread, got, errors


def _refused(r: httpx.Response, status: int, code: str, names: str) -> None:
    """A JSON refusal (never plain text, never a dropped connection) whose message names the field."""
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == code and names in err["message"], err


def test_bad_input_gets_a_json_4xx_naming_the_field_and_begins_nothing(tokenizer):
    with served(tokenizer) as (queue, http, stored):
        # a task query with a lone surrogate: refused before the episode is begun (was: begun, then a 500)
        _refused(http.post("/ajet/v1/episodes", content=b'{"task": {"query": "x\\ud800"}, "group_id": "G"}',
                           headers={"Content-Type": "application/json"}), 400, "invalid_string", "`task.query`")
        _refused(http.post("/ajet/v1/episodes", content=b'{"client_id": "\\udfff"}'), 400, "invalid_string",
                 "`client_id`")
        _refused(http.post("/ajet/v1/episodes", content=b'{"task": {"query": "q", "metadata": {"\\ud800": "\\ud800"}}}'),
                 400, "invalid_string", "`task.metadata.\\ud800`")
        # raw surrogate bytes (not a \u escape): json.loads decodes them with surrogatepass
        _refused(http.post("/ajet/v1/episodes", content=b'{"client_id": "\xed\xa0\x80"}'), 400, "invalid_string",
                 "`client_id`")
        # task metadata nested deeper than the bound (was: accepted, then torch.save recursed at the checkpoint)
        deep = {"task": {"query": "q", "metadata": _nested(600)}, "group_id": "G"}
        _refused(http.post("/ajet/v1/episodes", json=deep), 400, "too_deep", "`task.metadata.a.a")
        assert queue.status()["episodes"]["begun"] == 0 and http.get("/ajet/v1/status").status_code == 200

        ep = http.post("/ajet/v1/episodes", json={"client_id": "c"}).json()
        fin, tok = f"/ajet/v1/episodes/{ep['episode_id']}/finish", {"X-Ajet-Episode-Token": ep["episode_token"]}
        # a 400-digit integer reward (was: OverflowError, a 500 with a plain-text body)
        _refused(http.post(fin, content=b'{"reward": 1' + b"0" * 400 + b"}", headers=tok), 400, "invalid_body",
                 "`reward`")
        for bad in (b"NaN", b"Infinity", b"-Infinity", b"1" + b"0" * 400):
            _refused(http.post(fin, content=b'{"reward": 1, "metrics": {"m": ' + bad + b"}}", headers=tok),
                     400, "invalid_body", "`metrics.m`")
        _refused(http.post(fin, json={"reward": 1, "metadata": _nested(MAX_DEPTH + 1)}, headers=tok), 400,
                 "too_deep", "`metadata.a")
        _refused(http.post(fin, content=b'{"error": "\\ud83d"}', headers=tok), 400, "invalid_string", "`error`")
        _refused(http.post(f"/ajet/v1/episodes/{ep['episode_id']}/abort", content=b'{"reason": "\\ud83d"}',
                           headers=tok), 400, "invalid_string", "`reason`")
        assert stored == []                                        # the episode is still running: send it again
        r = http.post(fin, json={"reward": 1, "metrics": {"m": 0.5}, "metadata": _nested(MAX_DEPTH - 1)}, headers=tok)
        assert r.status_code == 200 and r.json()["status"] == "finished", r.text
        assert [e.episode_id for e in stored] == [ep["episode_id"]] and stored[0].output.metrics == {"m": 0.5}


def test_checkpointed_queue_state_with_metadata_at_the_bound_saves(tokenizer, tmp_path):
    """The depth bound leaves room for torch.save, which checkpoints open groups' tasks (their metadata)."""
    import torch

    with served(tokenizer) as (queue, http, _):
        task = {"query": "q", "metadata": _nested(MAX_DEPTH - 2)}     # body -> task -> metadata: MAX_DEPTH deep
        assert http.post("/ajet/v1/episodes", json={"task": task, "group_id": "G"}).status_code == 200
        torch.save(queue.state_dict(0), tmp_path / "state.pt")
        assert torch.load(tmp_path / "state.pt", weights_only=False)["open_groups"][0]["task"]["metadata"] == task["metadata"]


def test_only_the_client_that_began_an_episode_can_end_it(tokenizer):
    with served(tokenizer) as (queue, http, stored):
        a, b = (http.post("/ajet/v1/episodes", json={"client_id": c}).json() for c in ("a", "b"))
        assert a["episode_token"] != b["episode_token"] and len(a["episode_token"]) >= 32
        for how, body in (("finish", {"reward": 1.0}), ("abort", {}), ("heartbeat", {})):
            url = f"/ajet/v1/episodes/{a['episode_id']}/{how}"
            _refused(http.post(url, json=body), 403, "missing_episode_token", "X-Ajet-Episode-Token")
            _refused(http.post(url, json=body, headers={"X-Ajet-Episode-Token": b["episode_token"]}), 403,
                     "wrong_episode_token", a["episode_id"])
        _refused(http.post("/ajet/v1/episodes/nope/finish", json={"reward": 1.0}), 404, "episode_not_found", "'nope'")
        assert stored == [] and queue.status()["episodes"]["running"] == 2
        own = {"X-Ajet-Episode-Token": a["episode_token"]}
        assert http.post(f"/ajet/v1/episodes/{a['episode_id']}/heartbeat", json={}, headers=own).status_code == 200
        assert http.post(f"/ajet/v1/episodes/{a['episode_id']}/finish", json={"reward": 1.0}, headers=own).status_code == 200
        r = http.post(f"/ajet/v1/episodes/{a['episode_id']}/finish", json={"reward": 1.0},
                      headers={"X-Ajet-Episode-Token": b["episode_token"]})
        _refused(r, 403, "wrong_episode_token", a["episode_id"])  # an ended episode's state is its client's too

        client = AjetClient(str(http.base_url), secret=SECRET)           # the Python client carries the token itself
        with client.episode() as ep:
            llm = ep.openai(max_retries=0)
            llm.chat.completions.create(model=ep.model, messages=[{"role": "user", "content": ep.task["query"]}])
            ep.heartbeat()
            assert ep.finish(reward=0.5)["status"] == "finished"
        client.close()
        assert [e.reward for e in stored] == [1.0, 0.5] and len(stored[1].calls) == 1


CLIENT_KEY, ADMIN_KEY = "client-key-0123456789abcdef", "admin-key-0123456789abcdef"


def test_a_client_key_runs_episodes_and_sees_the_status_without_the_other_clients(tokenizer):
    """`serve.keys`: a client key begins and finishes episodes as the secret does; its status has no `clients`
    (who else runs episodes), an admin key's and the secret's have them; no key or an unknown one is a 401."""
    keys = [("alice", CLIENT_KEY, "client"), ("ops", ADMIN_KEY, "admin")]
    with served(tokenizer, keys=keys) as (queue, http, stored):
        with AjetClient(str(http.base_url), secret=CLIENT_KEY, client_id="alice-laptop") as alice:
            with alice.episode() as ep:
                r = ep.openai(max_retries=0).chat.completions.create(
                    model=ep.model, messages=[{"role": "user", "content": ep.task["query"]}])
                assert r.choices[0].message.content == "7"
                assert ep.finish(reward=1.0)["status"] == "finished"
            seen = alice.status()
        assert [e.reward for e in stored] == [1.0]
        assert seen["episodes"]["finished"] == 1 and "clients" not in seen
        for key in (ADMIN_KEY, SECRET):
            r = httpx.get(f"{http.base_url}/ajet/v1/status", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert r.status_code == 200 and r.json()["clients"]["alice-laptop"]["finished"] == 1, r.text
        for headers in ({}, {"Authorization": "Bearer not-a-key-0123456789abcdef"}):
            for method, path in (("POST", "/ajet/v1/episodes"), ("GET", "/ajet/v1/status")):
                r = httpx.request(method, f"{http.base_url}{path}", headers=headers, json={} if method == "POST"
                                  else None, timeout=30)
                _refused(r, 401, "invalid_secret", "serve.keys")
        assert queue.status()["episodes"]["running"] == 0


def test_both_clients_fail_the_episode_their_block_leaves_unfinished(tokenizer):
    """`AjetClient.episode()` and `AsyncAjetClient.episode()`: an exception in the block fails the episode with the
    block's traceback and goes on; a block left without `finish` fails it saying so; a finished one stays as is."""
    with served(tokenizer) as (queue, http, stored):
        client = AjetClient(str(http.base_url), secret=SECRET)
        with pytest.raises(ZeroDivisionError):
            with client.episode():
                raise ZeroDivisionError("sync block")
        with client.episode():
            pass
        client.close()

        async def clients_block() -> None:
            async with AsyncAjetClient(str(http.base_url), secret=SECRET) as aclient:
                with pytest.raises(KeyError):
                    async with aclient.episode():
                        raise KeyError("async block")
                async with aclient.episode():
                    pass
                async with aclient.episode() as ep:
                    await ep.finish(reward=0.25)

        asyncio.run(clients_block())
    assert [e.reward for e in stored] == [None, None, None, None, 0.25]
    assert "ZeroDivisionError: sync block" in stored[0].error and "Traceback" in stored[0].error
    assert "KeyError: 'async block'" in stored[2].error and "Traceback" in stored[2].error
    assert all(stored[i].error.endswith("the client left the episode block without calling finish()") for i in (1, 3))


def test_a_stalled_upload_does_not_keep_its_episode_alive(tokenizer):
    """Headers and a few bytes of a model call, then nothing: the episode idles out like any other."""
    clock = ManualClock()
    with served(tokenizer, idle_timeout_s=1.0, clock=clock) as (queue, http, stored):
        ep = http.post("/ajet/v1/episodes", json={"client_id": "stalls"}).json()
        clock.advance(0.5)
        host, port = http.base_url.host, http.base_url.port
        sock = socket.create_connection((host, port))
        path = ep["base_url"].split(f":{port}", 1)[1] + "/chat/completions"
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {ep['api_key']}\r\nContent-Length: 1000\r\n\r\n{{\"mod".encode())
        try:
            deadline = time.monotonic() + 120                 # a bound on the wait, not a speed target
            while queue.status()["clients"]["stalls"]["idle_s"] > 0:     # the server saw the upload start ...
                assert time.monotonic() < deadline, queue.status()
                time.sleep(0.05)
            clock.advance(1.5)                                # ... and nothing after it for longer than 1 s
            http.post("/ajet/v1/episodes", json={"client_id": "poke"})   # begin reaps idle episodes
            queue.flush()
            assert [e.episode_id for e in stored] == [ep["episode_id"]], queue.status()
            assert stored[0].error.startswith("abandoned: no call or heartbeat for 1s (client stalls)")
        finally:
            sock.close()


def test_clients_wait_for_a_restarted_server_when_the_trainer_stopped(tokenizer):
    """The trainer raised (the server answers 503 `server_restarting`, then goes away): `AjetClient.begin`
    waits and gets its episode from the server restarted on the same port, instead of `RunFinished`."""
    port = free_port()
    with served(tokenizer, port=port) as (queue, http, _):
        queue.close()                                    # what trainer.run's `finally` does when a step raised
        r = http.post("/ajet/v1/episodes", json={})
        _refused(r, 503, "server_restarting", "--resume")
        assert int(r.headers["retry-after"]) >= 1
        client = AjetClient(str(http.base_url), secret=SECRET, retry_for_s=60)
        waiting, got, errors = _begin_in_thread(client)
        time.sleep(1.0)                                  # it is retrying the 503s
    time.sleep(1.0)                                      # ... and the refused connections
    assert not got and not errors
    with served(tokenizer, port=port, attempt=1):        # `ajet serve --resume` on the same port
        waiting.join(60)
        assert errors == [] and got and got[0].episode_id.startswith("a1-")
    client.close()


def test_a_run_that_trained_every_step_still_says_run_finished(tokenizer):
    with served(tokenizer, total_steps=1) as (queue, http, _):
        queue.step_done(1)
        queue.close()
        _refused(http.post("/ajet/v1/episodes", json={}), 410, "run_finished", "1 steps")
        with pytest.raises(RunFinished):
            AjetClient(str(http.base_url), secret=SECRET, retry_for_s=5).begin()


def _chat(ep: dict) -> httpx.Response:
    """One model call of the episode `ep` (its wire form) through the proxy."""
    return httpx.post(ep["base_url"] + "/chat/completions", headers={"Authorization": f"Bearer {ep['api_key']}"},
                      json={"model": ep["model"], "messages": [{"role": "user", "content": "hi"}]}, timeout=120)


def _waiting(queue: EpisodeQueue, *args, **kwargs) -> tuple[threading.Thread, list[list[str]]]:
    """`queue.wait_until_clients_told(*args, **kwargs)` in a started thread; returns (thread, [its result])."""
    result: list[list[str]] = []
    waiter = threading.Thread(target=lambda: result.append(queue.wait_until_clients_told(*args, **kwargs)), daemon=True)
    waiter.start()
    return waiter, result


def test_the_finished_server_answers_until_a_busy_client_is_told(tokenizer):
    """The last step is trained while a client is still in an episode: the server answers on (its proxy calls,
    its finish) until that client's next `begin` hears 410 `run_finished`; a client silent for longer than
    `active_s` is not waited for. (A server that stopped at once left such a client retrying a refused
    connection for its whole `retry_for_s`, then failing with "unreachable".)"""
    clock = ManualClock()
    with served(tokenizer, total_steps=1, clock=clock) as (queue, http, _):
        http.post("/ajet/v1/episodes", json={"client_id": "gone"})            # then never heard from again
        clock.advance(3.5)
        ep = http.post("/ajet/v1/episodes", json={"client_id": "busy"}).json()
        queue.step_done(1)
        queue.close()
        waiter, result = _waiting(queue, timeout_s=30, active_s=3.0)
        for _ in range(8):                                     # 4 s of proxy calls, longer than active_s
            assert (chat := _chat(ep)).status_code == 200, chat.text
            clock.advance(0.5)
        assert waits_on(clock, waiter), result                 # still answering the busy client
        auth = {"X-Ajet-Episode-Token": ep["episode_token"]}
        assert http.post(f"/ajet/v1/episodes/{ep['episode_id']}/finish", json={"reward": 1.0},
                         headers=auth).status_code == 200
        clock.advance(2.5)
        assert waits_on(clock, waiter), result                 # finished, but not yet told
        _refused(http.post("/ajet/v1/episodes", json={"client_id": "busy"}), 410, "run_finished", "1 steps")
        waiter.join(60)                                        # told: done without the clock moving on (not when
        assert not waiter.is_alive() and result == [[]]        # it falls silent), and "gone" was not waited for


class HeldEngine(ScriptedEngine):
    """A scripted engine whose calls are answered only once `release` is set (a slow generation); `started`
    is set when a call reaches it."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, replies)
        self.started, self.release = threading.Event(), threading.Event()

    async def generate(self, prompt_ids, params, on_tokens=None):
        import asyncio

        self.started.set()
        await asyncio.to_thread(self.release.wait, 120)
        return await super().generate(prompt_ids, params, on_tokens)


def test_a_client_whose_model_call_outlasts_active_s_is_still_waited_for(tokenizer):
    """A generation longer than `active_s` (a long answer, a loaded engine): the client is busy while its call is
    in flight, however long since it was last heard from, so the server does not stop under it."""
    clock, engine = ManualClock(), HeldEngine(tokenizer, ["7"])
    with served(tokenizer, total_steps=1, clock=clock, engine=engine) as (queue, http, _):
        ep = http.post("/ajet/v1/episodes", json={"client_id": "busy"}).json()
        calls: list[httpx.Response] = []
        caller = threading.Thread(target=lambda: calls.append(_chat(ep)), daemon=True)
        caller.start()
        try:
            assert engine.started.wait(120)                    # the call is being generated
            queue.step_done(1)
            queue.close()
            waiter, result = _waiting(queue, timeout_s=30, active_s=3.0)
            clock.advance(10.0)                                # ... for longer than active_s
            assert waits_on(clock, waiter), result
        finally:
            engine.release.set()
        caller.join(120)
        assert calls and calls[0].status_code == 200, calls
        auth = {"X-Ajet-Episode-Token": ep["episode_token"]}
        assert http.post(f"/ajet/v1/episodes/{ep['episode_id']}/finish", json={"reward": 1.0},
                         headers=auth).status_code == 200
        _refused(http.post("/ajet/v1/episodes", json={"client_id": "busy"}), 410, "run_finished", "1 steps")
        waiter.join(60)
        assert not waiter.is_alive() and result == [[]]


def test_a_resumed_server_with_nothing_left_to_train_answers_the_waiting_clients(tokenizer):
    """Killed after its last checkpoint and resumed: the server has no step left, knows none of the clients
    retrying its port, and still answers for `listen_s` after it began serving, so each hears 410."""
    clock = ManualClock()
    with served(tokenizer, attempt=1, total_steps=1, clock=clock) as (queue, http, _):
        queue.step_done(1)
        queue.close()
        waiter, result = _waiting(queue, 30, 3.0, listen_s=2.5)
        clock.advance(1.0)
        assert waits_on(clock, waiter), result                 # no client known, but still listening
        _refused(http.post("/ajet/v1/episodes", json={"client_id": "retrying"}), 410, "run_finished", "1 steps")
        assert waits_on(clock, waiter), result                 # every client told, but listen_s is not over
        clock.advance(1.6)                                     # 2.6 s after the server began serving
        waiter.join(60)
        assert not waiter.is_alive() and result == [[]]


def test_nan_and_infinite_metrics_never_reach_metrics_jsonl(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log(1, {"loss": float("nan"), "kl": float("inf"), "reward": 0.5, "per_task": [1.0, float("-inf")]})
    log.close()

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")

    (row,) = [json.loads(line, parse_constant=strict) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row == {"step": 1, "loss": None, "kl": None, "reward": 0.5, "per_task": [1.0, None],
                   "nonfinite": ["kl", "loss", "per_task"]}
    assert not any(isinstance(v, float) and not math.isfinite(v) for v in row.values())


def test_a_client_waits_for_a_task_however_long_training_takes(tokenizer):
    """503 `no_task_available` comes from a live server (every place handed out, training catching up):
    `begin` keeps waiting past `retry_for_s`, which bounds only an unreachable or restarting server."""
    with served(tokenizer) as (queue, http, _):
        places = [http.post("/ajet/v1/episodes", json={"client_id": "busy"}).json() for _ in range(8)]
        assert http.post("/ajet/v1/episodes", json={}).json()["error"]["code"] == "no_task_available"
        client = AjetClient(str(http.base_url), secret=SECRET, retry_for_s=0.5)
        waiting, got, errors = _begin_in_thread(client)
        time.sleep(2.0)                                       # four times retry_for_s
        assert not got and not errors
        for ep in places[:4]:                                 # two groups complete; the trainer takes them
            http.post(f"/ajet/v1/episodes/{ep['episode_id']}/finish", json={"reward": 1.0},
                      headers={"X-Ajet-Episode-Token": ep["episode_token"]})
        queue.collect(1)
        waiting.join(30)
        assert errors == [] and got and got[0].group_id == "g4:" + got[0].task["task_id"]
        client.close()
