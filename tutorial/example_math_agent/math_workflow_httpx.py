"""The math agent with raw `httpx`: the same tool loop as math_workflow.py, as plain JSON over HTTP.

No SDK at all: POST `{tuner.base_url}/chat/completions` with the episode's api_key as the Bearer token
and read the OpenAI-format JSON answer. Prompt, tool schema, calculator and judge come from
math_workflow.py, so the variants differ only in the client.
"""

from __future__ import annotations

import httpx

from ajet import Task, Tuner, Workflow, WorkflowOutput
from math_workflow import CALCULATE_TOOL, MAX_TURNS, SYSTEM_PROMPT, CalculatorTool

FORCE_CALCULATE = {"type": "function", "function": {"name": "calculate"}}


class MathAgentHttpxWorkflow(Workflow):
    """One episode of the math agent over raw HTTP; same tool loop, reward and metrics as math_workflow.py.
    Raises httpx.HTTPStatusError if the proxy answers with an error."""

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.query}]
        calculator, answer = CalculatorTool(task.query), ""
        headers = {"Authorization": f"Bearer {tuner.api_key}"}
        async with httpx.AsyncClient(base_url=tuner.base_url, headers=headers, timeout=600) as http:
            for turn in range(1, MAX_TURNS + 1):
                r = await http.post("/chat/completions", json={
                    "model": tuner.model, "messages": messages, "tools": [CALCULATE_TOOL],
                    "tool_choice": FORCE_CALCULATE if turn == 1 else "auto"})
                r.raise_for_status()
                message = r.json()["choices"][0]["message"]
                answer = message.get("content") or ""
                if not message.get("tool_calls"):
                    break
                messages.append({k: v for k, v in message.items() if v is not None})
                for call in message["tool_calls"]:
                    result = await calculator.call(call["function"]["name"], call["function"]["arguments"])
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return WorkflowOutput(final_answer=answer, metrics={"turns": turn, **calculator.counts})
