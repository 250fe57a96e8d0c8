"""The replay gate (`gateway.gate.mode: replay`): a candidate policy is compared with the serving one on a replay
of the gateway's own recent traffic instead of a held-out task file.

The rule, for one update:

    1. the replay set: the first request of each of the `gateway.gate.replay_sessions` sessions whose latest
       feedback (client or judge) arrived last, among those with a recorded call that the update did not train
       on (`GatewayStore.replay_set`).
       A request is replayed as it was received: its messages and tool definitions (the proxy's OpenAI wire
       form, whichever dialect the client used), sent as one Chat Completions call
    2. the serving policy answers every request of the set (before the update, while live traffic goes on:
       the same weights), then the candidate answers the same set (live calls held), both with the `eval:`
       section's sampling (default greedy, so the two answers differ only because the weights do) through
       `ajet.eval.evaluate` (a proxy of its own over the same engine; `eval.n` answers per request)
    3. the config's `judge` scores every answer, as it scores a best-of-N candidate: `judge(task, output)` with
       the request's last user message as `task.query`, the whole request as `task.metadata["messages"]`
       (`"tools"`, the session id as `"session"`, its recorded reward as `"recorded_reward"`) and the answer's
       text as `output.final_answer` (the message as `output.metadata["message"]`)
    4. the gate compares `gateway.gate.metric` of the two evaluations on the same set (`reward_mean`: the mean
       judge score; `pass@1`: the share of answers scored at least `eval.pass_threshold`), with `max_drop`
       as in mode `eval`. Both figures are measured anew at each update: the set moves with the traffic, so a
       figure of an earlier update is not comparable

What it measures: whether the candidate answers the traffic the gateway serves now as well as the serving
policy does, by the judge's standard, on recent sessions it did not train on (a candidate cannot score by
having memorised its own training sessions). It is a regression check on recent traffic: a harmful update (one
that breaks the answers) is caught. Use mode `eval`
with `data.val_path` for a held-out figure. The recorded rewards are not the figure: they score the answers
that were served, not the candidate's.
"""

from __future__ import annotations

from typing import Any

from ajet.gateway.sessions import MAX_QUERY_CHARS, message_text
from ajet.gateway.store import GatewayStore
from ajet.task import Task
from ajet.workflow import Workflow, WorkflowOutput



def replay_tasks(store: GatewayStore, n: int, exclude: set[str] = frozenset()) -> list[Task]:
    """The replay set of step 1 (module docstring) as evaluation tasks, newest feedback first: task id
    `replay-<session id>`, query the request's last user message, metadata `messages`, `tools`, `session`,
    `recorded_reward`. Sessions in `exclude` (those the candidate trained on) are left out. Empty when no other
    rated session has a recorded call."""
    out = []
    for session_id, reward, call in store.replay_set(n, exclude):
        messages = call.get("messages") or []
        query = next((message_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        out.append(Task(task_id=f"replay-{session_id}", query=query[:MAX_QUERY_CHARS],
                        metadata={"messages": messages, "tools": call.get("tools"), "session": session_id,
                                  "recorded_reward": reward}))
    return out


class ReplayWorkflow(Workflow):
    """One Chat Completions call with a replayed request's messages and tools; the answer is left to the judge
    (`reward` None)."""

    async def execute(self, task: Task, tuner) -> WorkflowOutput:
        kwargs: dict[str, Any] = {"tools": task.metadata["tools"]} if task.metadata.get("tools") else {}
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=task.metadata["messages"], **kwargs)
        message = r.choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                "arguments": c.function.arguments}}
                 for c in message.tool_calls or []]
        return WorkflowOutput(reward=None, final_answer=message.content or "", metadata={"message": {
            "role": "assistant", "content": message.content, **({"tool_calls": calls} if calls else {})}})

