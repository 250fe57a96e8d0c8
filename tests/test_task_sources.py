"""Task sources (ajet/tasks/): JSONL, Hugging Face files and save_to_disk folders, generators, an env service."""

import asyncio
import json
import textwrap

import pytest

from ajet.config import load_config
from ajet.errors import ConfigError
from ajet.tasks import load_tasks
from ajet.tasks.env_service import EnvServiceClient, EnvServiceError
from ajet.workflow import WorkflowOutput
from tests.local_servers import free_port, serving

ROWS = [{"id": f"p{i}", "problem": f"What is {i} + {i}?", "solution": str(2 * i), "level": i % 3} for i in range(6)]


def _cfg(tmp_path, data: str, extra: str = ""):
    (tmp_path / "conf.yaml").write_text(f"workflow: wf.py:W\ndata: {data}\n{extra}")
    return load_config(tmp_path / "conf.yaml")


def test_jsonl_is_still_the_default_and_old_import_works(tmp_path):
    from ajet.tasks.jsonl import read_jsonl_tasks

    (tmp_path / "t.jsonl").write_text(json.dumps({"query": "q", "answer": "1"}) + "\n")
    tasks = load_tasks(_cfg(tmp_path, "{train_path: t.jsonl}"), "train")
    assert [(t.task_id, t.query, t.answer) for t in tasks] == [("t-0", "q", "1")]
    assert read_jsonl_tasks(tmp_path / "t.jsonl")[0].query == "q"


def test_local_parquet_file_with_column_mapping(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "train.parquet"))
    cfg = _cfg(tmp_path, "{train_path: train.parquet, columns: {query: problem, answer: solution, task_id: id}}")
    tasks = load_tasks(cfg, "train")
    assert [t.task_id for t in tasks] == [f"p{i}" for i in range(6)]
    assert tasks[3].query == "What is 3 + 3?" and tasks[3].answer == "6" and tasks[3].metadata == {"level": 0}
    bad = _cfg(tmp_path, "{train_path: train.parquet, columns: {query: prompt}}")
    with pytest.raises(ConfigError, match="prompt.*columns are"):
        load_tasks(bad, "train")


def test_load_from_disk_folder_picks_the_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:4]),
                               "test": datasets.Dataset.from_list(ROWS[4:])})
    dd.save_to_disk(str(tmp_path / "ds"))
    data = "{train_path: ds, val_path: ds, split: train, val_split: test, columns: {query: problem, answer: solution, task_id: id}}"
    cfg = _cfg(tmp_path, data)
    assert [t.task_id for t in load_tasks(cfg, "train")] == ["p0", "p1", "p2", "p3"]
    assert [t.task_id for t in load_tasks(cfg, "val")] == ["p4", "p5"]
    with pytest.raises(ConfigError, match="no split 'dev'"):
        load_tasks(_cfg(tmp_path, "{train_path: ds, split: dev, columns: {query: problem}}"), "train")
    # a single Dataset folder and a json file read the same way
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    (tmp_path / "rows.json").write_text("\n".join(json.dumps(r) for r in ROWS))
    for path in ("one", "rows.json"):
        cfg = _cfg(tmp_path, f"{{train_path: {path}, max_tasks: 2, columns: {{query: problem, task_id: id}}}}")
        assert [t.task_id for t in load_tasks(cfg, "train")] == ["p0", "p1"]


def test_generator_callable_gets_the_split(tmp_path):
    (tmp_path / "gen.py").write_text(textwrap.dedent("""
        from ajet.task import Task

        def tasks(split, n, offset=0):
            base = 0 if split == "train" else 1000
            for i in range(n):
                yield {"task_id": f"{split}-{i}", "query": f"{base + i + offset}?", "answer": str(base + i)}
            yield Task("extra", "a Task object works too")
    """))
    cfg = _cfg(tmp_path, "{generator: gen.py:tasks, generator_args: {n: 3}}")
    train, val = load_tasks(cfg, "train"), load_tasks(cfg, "val")
    assert [t.query for t in train] == ["0?", "1?", "2?", "a Task object works too"]
    assert [t.task_id for t in val][:3] == ["val-0", "val-1", "val-2"] and val[0].answer == "1000"
    with pytest.raises(ConfigError, match="exactly one task source"):
        _cfg(tmp_path, "{generator: gen.py:tasks, train_path: x.jsonl}")


def test_reasoning_gym_generator_and_its_scorer(tmp_path):
    from ajet.judges import countdown_judge
    from ajet.tasks.generator import reasoning_gym_judge

    cfg = _cfg(tmp_path, "{generator: 'ajet.tasks.generator:reasoning_gym_tasks', "
                         "generator_args: {dataset: countdown, size: 4, seed: 3}}")
    train, val = load_tasks(cfg, "train"), load_tasks(cfg, "val")
    assert len(train) == len(val) == 4 and {t.query for t in train}.isdisjoint(t.query for t in val)
    t = train[0]
    json.dumps(t.to_dict())                                          # metadata stays JSON-serialisable
    assert reasoning_gym_judge(t, WorkflowOutput(final_answer=t.answer)) == 1.0
    assert countdown_judge(t, WorkflowOutput(final_answer=t.answer)) == 1.0   # our scorer agrees with theirs
    assert reasoning_gym_judge(t, WorkflowOutput(final_answer="1+1")) < 1.0
    assert countdown_judge(t, WorkflowOutput(final_answer="")) == 0.0


# ---- an environment service over HTTP (AgentJet's env-service shape) --------------------------------
def _guess_service():
    """A tiny env service: guess the secret number of a task; reward 1 when the last guess was right."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    secrets = {"g1": 3, "g2": 7, "g3": 5, "v1": 9}
    instances: dict[str, dict] = {}

    async def handler(request: Request):
        body, op = await request.json(), request.url.path.strip("/")
        if op == "get_env_profile":
            split = body["params"]["split"]
            return JSONResponse({"data": [k for k in secrets if k.startswith("v" if split == "val" else "g")]})
        if op == "create":
            iid = f"i{len(instances)}"
            instances[iid] = {"secret": secrets[body["task_id"]], "right": False, "turns": 0}
            return JSONResponse({"data": {"state": [{"role": "user", "content": "Guess a number 0-9."}],
                                          "reward": 0, "is_terminated": False, "info": {"instance_id": iid}}})
        inst = instances.get(body.get("instance_id"))
        if inst is None:
            return JSONResponse({"detail": "unknown instance"}, status_code=404)
        if op == "step":
            inst["turns"] += 1
            inst["right"] = body["messages"]["content"].strip() == str(inst["secret"])
            done = inst["right"] or inst["turns"] >= 3
            hint = "right" if inst["right"] else "wrong"
            return JSONResponse({"data": {"state": [{"role": "user", "content": hint}], "reward": float(inst["right"]),
                                          "is_terminated": done, "info": {"instance_id": body["instance_id"]}}})
        if op == "evaluate":
            return JSONResponse({"data": float(inst["right"])})
        instances.pop(body["instance_id"])
        return JSONResponse({"data": True})

    return Starlette(routes=[Route(f"/{op}", handler, methods=["POST"])
                             for op in ("get_env_profile", "create", "step", "evaluate", "release")])


@pytest.fixture()
def env_url():
    with serving(_guess_service()) as url:
        yield url


def test_env_service_tasks_and_episode(tmp_path, env_url):
    cfg = _cfg(tmp_path, f"{{env_service: {{url: '{env_url}', env_type: guess}}}}")
    train, val = load_tasks(cfg, "train"), load_tasks(cfg, "val")
    assert [t.task_id for t in train] == ["g1", "g2", "g3"] and [t.task_id for t in val] == ["v1"]
    assert train[0].metadata == {"env_url": env_url, "env_type": "guess"}

    async def play(guesses):
        async with EnvServiceClient(env_url, "guess") as env:
            state = await env.create("g2")
            assert state.messages[0]["content"].startswith("Guess") and not state.is_terminated
            for g in guesses:
                state = await env.step(state.instance_id, {"role": "assistant", "content": g})
                if state.is_terminated:
                    break
            score = await env.evaluate(state.instance_id)
            assert await env.release(state.instance_id)
            with pytest.raises(EnvServiceError, match="404"):      # released: the service says so, clearly
                await env.evaluate(state.instance_id)
            return score, state.is_terminated

    assert asyncio.run(play(["1", "7"])) == (1.0, True)
    assert asyncio.run(play(["1", "2", "4"])) == (0.0, True)


def test_env_service_unreachable_is_a_clear_error(tmp_path):
    port = free_port()   # nothing listens there
    cfg = _cfg(tmp_path, f"{{env_service: {{url: 'http://127.0.0.1:{port}', env_type: guess}}}}")
    with pytest.raises(EnvServiceError, match="get_env_profile.*ConnectError"):
        load_tasks(cfg, "train")
