"""The MCP tutorial (tutorial/example_mcp_tools): its SQLite MCP server over stdio, its tasks' answers, and one
training step from its YAML alone (the built-in ToolAgent, no Python of the user's) with the tiny model."""

import asyncio
import json
import sqlite3
from pathlib import Path

import yaml

from ajet.config import ToolsConfig
from ajet.importing import load_object
from ajet.tools.mcp_hub import McpHub
from tests.ajet_cli import train_one_step

TUTORIAL = Path(__file__).resolve().parent.parent / "tutorial" / "example_mcp_tools"
# loaded by file path under a unique module name: the math tutorial has a make_tasks.py too
make_tasks = load_object(f"{TUTORIAL / 'make_tasks.py'}:make_tasks")
make_splits = load_object(f"{TUTORIAL / 'make_tasks.py'}:make_splits")


def _read(name: str) -> list[dict]:
    return [json.loads(line) for line in (TUTORIAL / "tasks" / name).read_text().splitlines()]


def test_tasks_files_match_the_database_and_hold_out_questions_never_trained():
    train, held_out = _read("train.jsonl"), _read("val.jsonl")
    assert (train, held_out) == make_splits() and len(train) >= 30 and len(held_out) >= 12
    assert all(r["answer"].isdigit() for r in train + held_out)
    assert not {r["query"] for r in train} & {r["query"] for r in held_out}
    # every kind of question is held out, none wholly: the first three words tell the template
    kinds = {" ".join(r["query"].split()[:3]) for r in held_out}
    assert len(kinds) == 4 and kinds <= {" ".join(r["query"].split()[:3]) for r in train}
    # the answers are the database's, by a query written here (not make_tasks.py's SQL)
    db = sqlite3.connect(":memory:")
    db.executescript((TUTORIAL / "shop.sql").read_text())
    berlin = db.execute("SELECT COUNT(*) FROM customers WHERE city = 'Berlin'").fetchone()[0]
    berlins = [r["answer"] for r in train + held_out if r["query"] == "How many customers live in Berlin?"]
    assert berlins == [str(berlin)]


def test_sqlite_server_answers_read_only_queries():
    conf = yaml.safe_load((TUTORIAL / "mcp_tools.yaml").read_text())["tools"]
    with McpHub(ToolsConfig(**{**conf, "max_calls_per_episode": 5}), base_dir=TUTORIAL) as hub:
        assert [t["function"]["name"] for t in hub.schemas] == ["query"]

        async def episode():
            tools = await hub.open_episode()
            return [await tools.call("query", {"sql": sql}) for sql in (
                "SELECT COUNT(*) FROM customers WHERE city = 'Berlin'",
                "DELETE FROM customers",
                "SELECT COUNT(*) FROM orders a, orders b, orders c, orders d",
                "SELEC nonsense",
                "SELECT COUNT(*) FROM customers WHERE city = 'Berlin'")]

        count, delete, runaway, garbage, again = asyncio.run(episode())
    berlin = next(t for t in make_tasks() if t["query"] == "How many customers live in Berlin?")["answer"]
    assert count.text == f"COUNT(*)\n{berlin}" and again.text == count.text     # the delete changed nothing
    assert delete.is_error and "readonly" in delete.text
    assert runaway.is_error and "interrupted" in runaway.text
    assert garbage.is_error and "syntax error" in garbage.text


def test_trains_one_step_from_the_yaml_alone(tiny_model_dir, tmp_path):
    conf = yaml.safe_load((TUTORIAL / "mcp_tools.yaml").read_text())
    conf["model"]["path"] = tiny_model_dir
    conf["data"] = {"train_path": str(TUTORIAL / conf["data"]["train_path"])}     # (no held-out evaluation)
    conf["trainer"].pop("best_metric")
    conf["tools"]["mcp_servers"]["shop"]["cwd"] = str(TUTORIAL)   # the copy lives elsewhere
    conf["trainer"].update(tasks_per_step=2, tensorboard=False, val_freq=0)
    conf["rollout"]["num_repeat"] = 2
    proc, exp = train_one_step(conf, tmp_path)
    assert "MCP tools: query" in proc.stdout
    (metrics,) = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert metrics["rollout/episodes"] == 4 and metrics["rollout/failed"] == 0
    episodes = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    for ep in episodes:   # the first turn forced the query tool's opening; the random model writes the rest
        assert ep["calls"][0]["forced_text"] == '<tool_call>\n{"name": "query", "arguments": {"sql": "'
    recorded = sum(len(ep["tool_calls"]) for ep in episodes)
    assert metrics.get("tools/calls", 0) == recorded
