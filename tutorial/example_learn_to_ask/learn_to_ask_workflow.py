"""Learn to ask: given an underspecified request, the agent asks one clarifying question (it must not answer).

The reward comes from the LLM judge (`ajet.judges.llm:LLMJudge`, rubric.txt): by default a frozen copy of
the initial policy, served by ajet and never trained, reads the request, the missing detail (the task's
reference answer) and the agent's question, and answers yes (1) or no (0). A reply it cannot parse gives
reward 0 and is recorded in the episode (`metadata.llm_judge`, metric `judge_parse_failed`).
"""

from __future__ import annotations

from ajet import Task, Tuner, Workflow, WorkflowOutput

SYSTEM_PROMPT = ("You are a helpful assistant. The user's request is missing an important detail. Do not answer "
                 "it yet: ask the user one short question to get the missing detail.")


class LearnToAskWorkflow(Workflow):
    """One turn: the agent's question is the final answer the judge scores. Metrics: is_question."""

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=[
            {"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.query}])
        question = r.choices[0].message.content or ""
        return WorkflowOutput(final_answer=question, metrics={"is_question": float("?" in question)})
