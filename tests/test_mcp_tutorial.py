"""The MCP tutorial (tutorial/example_mcp_tools): its SQLite MCP server over stdio, its tasks' answers, and one
training step from its YAML alone (the built-in ToolAgent, no Python of the user's) with the tiny model."""

import asyncio
import json
from pathlib import Path

import yaml

from ajet.config import ToolsConfig
from ajet.importing import load_object
from ajet.tools.mcp_hub import McpHub
from tests.ajet_cli import train_one_step

TUTORIAL = Path(__file__).resolve().parent.parent / "tutorial" / "example_mcp_tools"
# loaded by file path under a unique module name: the math tutorial has a make_tasks.py too
make_tasks = load_object(f"{TUTORIAL / 'make_tasks.py'}:make_tasks")


def test_tasks_file_matches_the_database():
    rows = [json.loads(line) for line in (TUTORIAL / "tasks" / "train.jsonl").read_text().splitlines()]
    assert rows == make_tasks() and len(rows) >= 40
    assert all(r["answer"].isdigit() for r in rows)


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
    conf["data"]["train_path"] = str(TUTORIAL / conf["data"]["train_path"])
    conf["tools"]["mcp_servers"]["shop"]["cwd"] = str(TUTORIAL)   # the copy lives elsewhere
    conf["trainer"].update(tasks_per_step=2, tensorboard=False)
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
