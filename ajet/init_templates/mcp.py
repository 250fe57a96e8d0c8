"""`ajet init --kind mcp`: the built-in tool agent over the project's own MCP server, from YAML alone."""

import json

SUMMARY = "a tool agent from YAML alone: the built-in ToolAgent calls the project's MCP server (server.py, stdio)"

CONFIG = """\
# {{project}}: a tool agent over an MCP server (written by `ajet init --kind mcp`). Run from this folder:
#   ajet --conf ajet.yaml --backbone=debug        outputs go to experiments/{{project}}/
# No Python of yours runs an episode: the built-in ToolAgent calls the policy with the server's tools, runs each
# tool call on the server and sends the result back, until a reply without a tool call. ajet starts server.py
# once for the run. Every key is in ajet's configuration reference (docs/configuration.md).
experiment_name: {{project}}
workflow: ajet.tool_agent:ToolAgent
judge: ajet.judges:answer_with_tool_use_judge   # 1 for the right number + 0.2 when a tool call ran without error
model:
  path: smollm2-135m-instruct           # the bundled SmolLM2-135M-Instruct; or a Hugging Face id or a folder
  max_model_len: 1536
data:
  train_path: tasks.jsonl
rollout:
  num_repeat: 4                         # episodes per task: one GRPO group
  temperature: 0.7
  max_tokens: 64                        # per call
tools:
  mcp_servers:
    warehouse:                          # any stdio server (command + args) or a streamable-HTTP one (url)
      command: python                   # the trainer's own interpreter
      args: [server.py]                 # relative to this file's folder
  max_calls_per_episode: 4
  call_timeout_s: 10
  agent:
    max_turns: 3
    first_tool_choice: stock            # the first turn calls `stock` (a small model rarely starts a call itself)
    system_prompt: >-
      You answer questions about the warehouse. Call the stock tool with the item's name (plural, e.g. apples),
      then reply: The answer is N.
trainer:
  total_steps: 8
  tasks_per_step: 2
algorithm:
  lr: 1.0e-5
"""

STOCK = {"apples": 120, "bananas": 75, "chairs": 14, "lamps": 9, "pencils": 300, "tables": 6, "mugs": 48, "books": 210}

SERVER = '''\
"""The project's MCP server (stdio, the `mcp` package's FastMCP): one tool, `stock(item)`.

ajet starts it once per run (ajet.yaml's tools.mcp_servers.warehouse), lists its tools for every episode and
runs the model's tool calls on it. An item is found by its name in any case, singular or plural; an unknown
item is an error result, which the model sees.

    python server.py        # speaks MCP on stdin and stdout
"""

from mcp.server.fastmcp import FastMCP

STOCK = ''' + repr(STOCK) + '''

app = FastMCP("warehouse", log_level="WARNING")


@app.tool()
def stock(item: str) -> str:
    """How many units of an item the warehouse holds, e.g. stock("lamps")."""
    key = item.strip().lower()
    key = key if key in STOCK else key + "s"          # "lamp" and "Lamps" are lamps too
    if key not in STOCK:
        raise ValueError(f"unknown item {item!r}; the items are: {', '.join(sorted(STOCK))}")
    return str(STOCK[key])


if __name__ == "__main__":
    app.run("stdio")
'''

_ONE = [(f"How many {item} are in the warehouse?", STOCK[item]) for item in ("lamps", "apples", "chairs", "books")]
_TWO = [(f"How many {a} and {b} does the warehouse hold together?", STOCK[a] + STOCK[b])
        for a, b in (("tables", "chairs"), ("mugs", "pencils"))]
_LEFT = [("The warehouse sells 20 bananas. How many bananas are left?", STOCK["bananas"] - 20),
         ("Each box holds 3 lamps. How many full boxes can the warehouse fill with its lamps?", STOCK["lamps"] // 3)]
TASKS = "".join(json.dumps({"task_id": f"stock-{i}", "query": q, "answer": str(a)}) + "\n"
                for i, (q, a) in enumerate(_ONE + _TWO + _LEFT))

FILES = {"ajet.yaml": CONFIG, "server.py": SERVER, "tasks.jsonl": TASKS}
