"""The math agent: a plain OpenAI SDK tool loop. It knows nothing about ajet beyond `tuner.client`.

The first turn asks for a `calculate(expression)` call (`tool_choice` names the function: a 135M model
rarely starts a tool call on its own); each call is answered with a `tool` message; later turns are free
(`tool_choice="auto"`) and the loop ends when the model answers without a tool call (or after MAX_TURNS). The judge in
math_agent.yaml scores the last answer against the reference, with a small bonus for valid and grounded calls
(`math_agent_reward`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import ClassVar

from ajet import Task, Tuner, Workflow, WorkflowOutput
from ajet.judges import math_answer_judge
from ajet.tools.sandbox import run_python_async
from calculator import format_value, safe_eval  # noqa: F401 - re-exported for tests and variants

MAX_TURNS = 3
CALCULATOR_SOURCE = (Path(__file__).resolve().parent / "calculator.py").read_text()
SYSTEM_PROMPT = ("You are a math assistant. First call the calculate tool with the arithmetic expression that "
                 "answers the question. Then use its result and reply: The answer is N.")
# No example expression in the description: with one (`3 + 4 * 2`) the 135M model copied it into its calls, a valid
# call that GRPO could settle on for every problem (docs/algorithm.md); the description asks for the question's
# own numbers instead
CALCULATE_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": ("Evaluate an arithmetic expression with + - * / and parentheses, "
                        "written with the numbers the question gives."),
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


class MathAgentWorkflow(Workflow):
    max_turns = MAX_TURNS                                                  # model calls per episode, at most
    first_turn_tool_choice: ClassVar[str | dict] = {"type": "function", "function": {"name": "calculate"}}

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.query}]
        calculator, answer = CalculatorTool(task.query), ""
        for turn in range(1, self.max_turns + 1):
            response = await tuner.client.chat.completions.create(
                model=tuner.model, messages=messages, tools=[CALCULATE_TOOL],
                tool_choice=self.first_turn_tool_choice if turn == 1 else "auto")
            message = response.choices[0].message
            answer = message.content or ""
            if not message.tool_calls:
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = await calculator.call(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return WorkflowOutput(final_answer=answer, metrics={"turns": turn, **calculator.counts})


def math_agent_reward(task: Task, output: WorkflowOutput) -> float:
    """1.0 for the right final number (`ajet.judges.math_answer_judge`) + 0.1 when the agent made a valid calculate
    call + 0.1 more when a valid call was grounded (`CalculatorTool`: the question's own numbers): at most 1.2.

    Why two small terms: a flat +0.2 for any valid call let GRPO settle on one valid expression for every problem
    (seeds 0 and 2 of the main job wrote the tool description's then example `3 + 4 * 2` in nearly every call from
    step 8, a +0.2 that no group could beat, and lost held-out accuracy). With the grounded term, a group whose calls
    are all valid still prefers the call that computes with this problem's numbers, the step before the right answer.
    A number counts as often as the question gives it (seed 2 otherwise settled on `1 + 1` for "... gets 1 more").
    """
    metrics = output.metrics
    return (math_answer_judge(task, output) + (0.1 if metrics.get("valid_tool_calls", 0) > 0 else 0.0)
            + (0.1 if metrics.get("grounded_tool_calls", 0) > 0 else 0.0))


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def numbers_in(text: str) -> Counter[str]:
    """The numbers written in `text`, without sign, with how often each occurs: "8 pens and 8 more" -> {"8": 2}."""
    return Counter(_NUMBER.findall(text))


def is_grounded(expression: str, known_numbers: Counter[str]) -> bool:
    """True when `expression` has at least two numbers, each taken from `known_numbers` at most as often as it
    occurs there: "8 + 8" is grounded in "8 pens and 8 more", "1 + 1" is not in "9 apples and 1 more"."""
    numbers = numbers_in(expression)
    return numbers.total() >= 2 and numbers <= known_numbers


class CalculatorTool:
    """One episode's `calculate` tool and its counts; the four client variants (OpenAI SDK, AgentScope, LangChain,
    httpx) all call it, so they report the same metrics.

    `counts` (the workflow's metrics): `tool_calls` (every call, any tool name), `valid_tool_calls` (the
    calculator returned a value), `grounded_tool_calls` (valid, with at least two numbers in the expression, each
    one of the question's numbers or an earlier call's result, used at most as often as it was given: `is_grounded`).
    """

    def __init__(self, query: str) -> None:
        self.known_numbers = numbers_in(query)
        self.counts = {"tool_calls": 0, "valid_tool_calls": 0, "grounded_tool_calls": 0}

    async def call(self, name: str, arguments: str) -> str:
        """Run one tool call (`name`, JSON `arguments`) and `count` it; returns the tool message's text,
        "error: ..." on failure (never raises)."""
        result = await calculate_tool(arguments) if name == "calculate" else f"error: unknown tool {name!r}"
        self.count(name, arguments, result)
        return result

    def count(self, name: str, arguments: str, result: str) -> None:
        """Count one tool call whose `result` is known (from `call`, or from a tool loop that ran the calculator
        itself, as TRL's does in benchmarks/trl_grpo_job.py)."""
        self.counts["tool_calls"] += 1
        if name != "calculate" or result.startswith("error:"):
            return
        self.counts["valid_tool_calls"] += 1
        expression = str(json.loads(arguments)["expression"])             # valid: the arguments parsed
        self.counts["grounded_tool_calls"] += is_grounded(expression, self.known_numbers)
        self.known_numbers += numbers_in(result)


async def calculate_tool(arguments: str) -> str:
    """The tool: JSON arguments {"expression": str} -> the value as text, or "error: ..." (never raises).

    The expression is evaluated by `calculator.safe_eval` in the tool sandbox (`ajet.tools.sandbox`: no network,
    no environment, 10 s, 256 MiB), so nothing the model writes can hang, exhaust or read the training process.
    A calculation takes milliseconds (`safe_eval` caps exponents at 100); the limit is that long because it
    counts the sandbox's start-up too, which took over 2 s (the earlier limit) on the 2-core machine at load
    ~10, where a right call then failed as "took too long" and the episode's reward depended on the load.
    It is awaited: while the child runs, the event loop serves the other episodes' model calls, so their
    next turns reach the engine in the same batch instead of waiting behind this tool.
    """
    try:
        expression = str(json.loads(arguments)["expression"])
    except Exception as exc:  # noqa: BLE001 - the model sees the error and may try again
        return f"error: {exc}"
    result = await run_python_async(CALCULATOR_SOURCE, timeout_s=10.0, memory_mb=256, stdin=expression)
    if result.timed_out:
        return "error: the calculation took too long"
    return result.stdout.strip() if result.ok else "error: the calculation failed"
