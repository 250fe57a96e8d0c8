"""Countdown with an AgentScope `ReActAgent`: reach the target from the given numbers.

The agent (AgentScope 2.x `Agent`, a ReAct loop) talks to the episode's proxy through `OpenAIChatModel`. It
may call `check(expression)` to see an expression's value before it answers; the final reply holds the
expression, scored by `ajet.judges:countdown_judge` (1.0 for the target, 0.1 for a well-formed expression
over the given numbers, 0 otherwise). Tasks come from reasoning-gym's countdown generator (countdown.yaml).
"""

from __future__ import annotations

from agentscope.agent import Agent, InjectionConfig, ReActConfig
from agentscope.credential import OpenAICredential
from agentscope.message import UserMsg
from agentscope.model import OpenAIChatModel
from agentscope.permission import PermissionBehavior, PermissionDecision
from agentscope.tool import FunctionTool, Toolkit

from ajet import Task, Tuner, Workflow, WorkflowOutput
from ajet.judges.countdown import _eval, extract_expression

MAX_ITERS = 2
SYSTEM_PROMPT = ("You solve countdown puzzles. Combine the given numbers with + - * / to reach the target; "
                 "use each number at most once. Reply with only the expression, e.g. 3 + 4 * 2.")
CHECK_SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}


def check(expression: str) -> str:
    """The exact value of an arithmetic expression (or why it is not one)."""
    import ast

    try:
        value = _eval(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc or 'not an arithmetic expression'}"
    return str(value)


class CountdownAgentWorkflow(Workflow):
    """One episode: a ReAct agent answers `task.query` (reasoning-gym's countdown question). Metrics:
    model_calls, checks (tool calls), has_expression."""

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        checks = {"n": 0}

        def counted_check(expression: str) -> str:
            checks["n"] += 1
            return check(expression)

        tool = FunctionTool(counted_check, name="check", description="The value of an arithmetic expression.",
                            input_schema=CHECK_SCHEMA,
                            permission=PermissionDecision(behavior=PermissionBehavior.ALLOW, message="pure"))
        model = OpenAIChatModel(credential=OpenAICredential(api_key=tuner.api_key, base_url=tuner.base_url),
                                model=tuner.model, max_retries=2, client_kwargs={"timeout": 600})
        agent = Agent(name="countdown", system_prompt=SYSTEM_PROMPT, model=model, toolkit=Toolkit(tools=[tool]),
                      react_config=ReActConfig(max_iters=MAX_ITERS),
                      injection_config=InjectionConfig(inject_runtime_state=False))
        try:
            reply = await agent.reply(UserMsg(name="user", content=task.query))
        finally:
            await model.client.close()
        text = reply.get_text_content() or ""
        return WorkflowOutput(final_answer=text, metrics={"checks": checks["n"],
                                                          "has_expression": float(extract_expression(text) is not None)})
