"""The math agent with AgentScope 2.x: a ReAct `Agent` whose `OpenAIChatModel` talks to the episode's proxy.

The model streams (AgentScope's default); `calculate` is registered in a `Toolkit` as a `FunctionTool`
with the same schema as math_workflow.py and allowed to run without asking. A small model-call middleware
forces the calculate tool on the first call (as math_workflow.py does with `tool_choice`) and counts the
turns. Runtime-state injection (a `<current-time>` reminder) is turned off: a math task has no use for the
time, and it would put ~60 tokens of changing text into every training sample (it is appended, so the
calls would still merge into one sample).
"""

from __future__ import annotations

import json

from agentscope.agent import Agent, InjectionConfig, ReActConfig
from agentscope.credential import OpenAICredential
from agentscope.message import UserMsg
from agentscope.middleware import MiddlewareBase
from agentscope.model import OpenAIChatModel
from agentscope.permission import PermissionBehavior, PermissionDecision
from agentscope.tool import FunctionTool, ToolChoice, Toolkit

from ajet import Task, Tuner, Workflow, WorkflowOutput
from math_workflow import CALCULATE_TOOL, MAX_TURNS, SYSTEM_PROMPT, CalculatorTool


class _ForceFirstToolCall(MiddlewareBase):
    """Forces `calculate` on the agent's first model call and counts the model calls."""

    def __init__(self) -> None:
        self.model_calls = 0

    async def on_model_call(self, agent, input_kwargs, next_handler):
        self.model_calls += 1
        if self.model_calls == 1:
            return await next_handler(tool_choice=ToolChoice(mode="calculate"))
        return await next_handler()


class MathAgentAgentScopeWorkflow(Workflow):
    """One episode: a ReAct agent solves `task.query` with the calculate tool; the YAML's judge (`math_agent_reward`)
    scores it (1 for the right number + 0.1 for a valid tool call + 0.1 for a grounded one). Metrics: turns and
    `CalculatorTool`'s counts."""

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        calculator = CalculatorTool(task.query)

        async def calculate(expression: str) -> str:
            return await calculator.call("calculate", json.dumps({"expression": expression}))

        tool = FunctionTool(calculate, description=CALCULATE_TOOL["function"]["description"],
                            input_schema=CALCULATE_TOOL["function"]["parameters"],
                            permission=PermissionDecision(behavior=PermissionBehavior.ALLOW,
                                                          message="calculate is side-effect free"))
        model = OpenAIChatModel(credential=OpenAICredential(api_key=tuner.api_key, base_url=tuner.base_url),
                                model=tuner.model, max_retries=2, client_kwargs={"timeout": 600})
        middleware = _ForceFirstToolCall()
        agent = Agent(name="math_agent", system_prompt=SYSTEM_PROMPT, model=model, toolkit=Toolkit(tools=[tool]),
                      middlewares=[middleware], react_config=ReActConfig(max_iters=MAX_TURNS),
                      injection_config=InjectionConfig(inject_runtime_state=False))
        try:
            reply = await agent.reply(UserMsg(name="user", content=task.query))
        finally:
            await model.client.close()
        return WorkflowOutput(final_answer=reply.get_text_content() or "",
                              metrics={"turns": middleware.model_calls, **calculator.counts})
