"""`ToolAgent`: a built-in tool-calling agent over the run's MCP tools, so a tool agent trains from YAML alone.

    workflow: ajet.tool_agent:ToolAgent
    judge: ajet.judges:answer_with_tool_use_judge
    tools:
      mcp_servers: {db: {command: python, args: [sqlite_server.py]}}
      agent: {system_prompt: "...", max_turns: 4, first_tool_choice: query}

One episode is a Chat Completions loop (the same loop as the math tutorial's agent): the model sees the task's
query and `tuner.tools`; each tool call it makes is run with `tuner.call_tool` (recorded, limited, timed out per
episode) and answered with a `tool` message; the episode ends at the first reply without a tool call, whose
text is the final answer, or after `max_turns` model calls (the last reply's text is the answer then).
"""

from __future__ import annotations

from typing import Any

from ajet.config import AjetConfig, ToolAgentConfig
from ajet.task import Task
from ajet.workflow import Tuner, Workflow, WorkflowOutput


class ToolAgent(Workflow):
    """The tool loop, configured by the `tools.agent` section (system prompt, max turns, first tool choice).

    Metrics per episode: turns (model calls), tool_calls, valid_tool_calls (calls without an error result).
    Metadata: nothing beyond the episode's own record of tool calls (`Episode.tool_calls`).
    """

    def __init__(self, settings: ToolAgentConfig | None = None):
        self.settings = settings or ToolAgentConfig()

    @classmethod
    def from_config(cls, cfg: AjetConfig) -> ToolAgent:
        """The agent the trainer builds: `tools.agent` of the experiment config."""
        return cls(cfg.tools.agent)

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        s = self.settings
        if not tuner.tools:
            raise RuntimeError("ToolAgent needs tools: add MCP servers under `tools.mcp_servers` in the config")
        messages: list[dict[str, Any]] = [{"role": "system", "content": s.system_prompt},
                                          {"role": "user", "content": task.query}]
        answer, calls, valid, turn = "", 0, 0, 0
        for turn in range(1, s.max_turns + 1):
            response = await tuner.client.chat.completions.create(
                model=tuner.model, messages=messages, tools=tuner.tools,
                tool_choice=_tool_choice(s.first_tool_choice) if turn == 1 else "auto")
            message = response.choices[0].message
            answer = message.content or ""
            if not message.tool_calls:
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = await tuner.call_tool(call.function.name, call.function.arguments)
                calls += 1
                valid += not result.is_error
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})
        return WorkflowOutput(final_answer=answer, metrics={"turns": turn, "tool_calls": calls,
                                                            "valid_tool_calls": valid})


def _tool_choice(choice: str) -> str | dict[str, Any]:
    """"auto" / "required" / "none" as they are; any other value names a function."""
    if choice in ("auto", "required", "none"):
        return choice
    return {"type": "function", "function": {"name": choice}}
