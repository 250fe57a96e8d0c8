"""The math agent with LangChain: `ChatOpenAI` pointed at the episode's proxy endpoint, a manual tool loop.

`ChatOpenAI(base_url=tuner.base_url, api_key=tuner.api_key, model=tuner.model)` is all ajet needs. The
first turn forces the calculate tool (`bind_tools(..., tool_choice="calculate")`), later turns are free;
prompt, tool schema, calculator and judge come from math_workflow.py.
"""

from __future__ import annotations

import json

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI

from ajet import Task, Tuner, Workflow, WorkflowOutput
from math_workflow import CALCULATE_TOOL, MAX_TURNS, SYSTEM_PROMPT, CalculatorTool


class MathAgentLangChainWorkflow(Workflow):
    """One episode of the math agent through LangChain's `ChatOpenAI`; same tool loop, reward and metrics as
    math_workflow.py."""

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        # use_responses_api=False: ajet's proxy serves Chat Completions only
        llm = ChatOpenAI(base_url=tuner.base_url, api_key=tuner.api_key, model=tuner.model, max_retries=2,
                         timeout=600, use_responses_api=False)
        forced = llm.bind_tools([CALCULATE_TOOL], tool_choice="calculate")
        free = llm.bind_tools([CALCULATE_TOOL], tool_choice="auto")
        messages = [SystemMessage(SYSTEM_PROMPT), HumanMessage(task.query)]
        calculator, answer = CalculatorTool(task.query), ""
        for turn in range(1, MAX_TURNS + 1):
            ai = await (forced if turn == 1 else free).ainvoke(messages)
            answer = ai.text   # the content as text (str content or the text parts of a list)
            # invalid_tool_calls: arguments LangChain could not parse; they are sent back as tool calls,
            # so each needs an answer too
            pending = [(tc["id"], tc["name"], json.dumps(tc["args"])) for tc in ai.tool_calls] + \
                      [(tc["id"], tc["name"], tc.get("args") or "") for tc in ai.invalid_tool_calls]
            if not pending:
                break
            messages.append(ai)
            for call_id, name, arguments in pending:
                result = await calculator.call(name, arguments)
                messages.append(ToolMessage(result, tool_call_id=call_id))
        return WorkflowOutput(final_answer=answer, metrics={"turns": turn, **calculator.counts})
