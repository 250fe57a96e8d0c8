"""The math agent: a plain OpenAI SDK tool loop. It knows nothing about ajet beyond `tuner.client`.

The first turn asks for a `calculate(expression)` call (`tool_choice` names the function: a 135M model
rarely starts a tool call on its own); each call is answered with a `tool` message; later turns are free
(`tool_choice="auto"`) and the loop ends when the model answers without a tool call (or after MAX_TURNS). The judge in math_agent.yaml scores
the last answer against the reference (`math_agent_reward`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ajet import Task, Tuner, Workflow, WorkflowOutput
from ajet.judges import answer_with_tool_use_judge
from ajet.tools.sandbox import run_python_async
from calculator import format_value, safe_eval  # noqa: F401 - re-exported for tests and variants

MAX_TURNS = 3
CALCULATOR_SOURCE = (Path(__file__).resolve().parent / "calculator.py").read_text()
SYSTEM_PROMPT = ("You are a math assistant. First call the calculate tool with the arithmetic expression that "
                 "answers the question. Then use its result and reply: The answer is N.")
CALCULATE_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses, e.g. '3 + 4 * 2'.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


class MathAgentWorkflow(Workflow):
    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.query}]
        answer, tool_calls, valid_calls = "", 0, 0
        for turn in range(1, MAX_TURNS + 1):
            response = await tuner.client.chat.completions.create(
                model=tuner.model, messages=messages, tools=[CALCULATE_TOOL],
                tool_choice={"type": "function", "function": {"name": "calculate"}} if turn == 1 else "auto")
            message = response.choices[0].message
            answer = message.content or ""
            if not message.tool_calls:
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = await calculate_tool(call.function.arguments) if call.function.name == "calculate" \
                    else f"error: unknown tool {call.function.name!r}"
                tool_calls += 1
                valid_calls += not result.startswith("error:")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return WorkflowOutput(final_answer=answer,
                              metrics={"turns": turn, "tool_calls": tool_calls, "valid_tool_calls": valid_calls})


def math_agent_reward(task: Task, output: WorkflowOutput) -> float:
    """1.0 for the right final number, plus 0.2 when the agent made at least one valid calculate call
    (`ajet.judges.answer_with_tool_use_judge`, reading this workflow's `valid_tool_calls` metric)."""
    return answer_with_tool_use_judge(task, output)


async def calculate_tool(arguments: str) -> str:
    """The tool: JSON arguments {"expression": str} -> the value as text, or "error: ..." (never raises).

    The expression is evaluated by `calculator.safe_eval` in the tool sandbox (`ajet.tools.sandbox`: no network,
    no environment, 2 s, 256 MiB), so nothing the model writes can hang, exhaust or read the training process.
    It is awaited: while the child runs, the event loop serves the other episodes' model calls, so their
    next turns reach the engine in the same batch instead of waiting behind this tool.
    """
    try:
        expression = str(json.loads(arguments)["expression"])
    except Exception as exc:  # noqa: BLE001 - the model sees the error and may try again
        return f"error: {exc}"
    result = await run_python_async(CALCULATOR_SOURCE, timeout_s=2.0, memory_mb=256, stdin=expression)
    if result.timed_out:
        return "error: the calculation took too long"
    return result.stdout.strip() if result.ok else "error: the calculation failed"
