"""A reward model behind an HTTP endpoint as the judge: each answer is scored by a trained reward model instead of
a rubric prompt (e.g. the gateway's best-of-N pick, `gateway.n`).

    judge: ajet.judges.reward_model:RewardModelJudge
    reward_model:
      base_url: http://rm-host:8000     # vLLM serving a reward model (`vllm serve <reward model>`)
      model: my-reward-model            # the name the endpoint serves it under
      api_key: null

The endpoint is vLLM's pooling API, `POST {base_url}/pooling` with `{"model", "messages"}`: the conversation
being judged in chat format (the request's messages when the task carries them, `task.metadata["messages"]`,
else the task's query as one user message), then the answer as the assistant's message
(`output.metadata["message"]` when the caller gives it, tool calls included, else `output.final_answer`). The
server renders them with the reward model's own chat template. The reward is read from the first result,
`data[0].data`: a number; a list of one number (a sequence-level head); or one row per token (a token-level
head, `[[r_1], ..., [r_T]]`), of which the last token's row is the sequence's reward. Anything else (several
labels per position, an HTTP error, a non-finite value) raises, and the caller treats the answer as unscored
(the gateway never picks it unless every candidate failed).

The wire format is the one vLLM documents for its pooling endpoint; ajet's tests check the judge against a local
stand-in server that answers in that shape, not against vLLM itself.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ajet.errors import ConfigError
from ajet.task import Task
from ajet.workflow import WorkflowOutput

if TYPE_CHECKING:
    from ajet.config import AjetConfig


class RewardModelJudge:
    """`judge(task, output) -> float`: the reward model's score of the answer (module docstring).

    Args:
        cfg: the config; its `reward_model` section names the endpoint.

    Raises:
        ConfigError: `reward_model.base_url` is not set.
    """

    def __init__(self, cfg: AjetConfig):
        import httpx

        rm = cfg.reward_model
        if not rm.base_url:
            raise ConfigError("judge RewardModelJudge needs reward_model.base_url: the address of the server that "
                              "serves the reward model (e.g. vLLM: http://host:8000)")
        self.url, self.model = rm.base_url.rstrip("/") + "/pooling", rm.model
        headers = {"Authorization": f"Bearer {rm.api_key}"} if rm.api_key else {}
        self._http = httpx.Client(timeout=rm.timeout_s, headers=headers)

    def __call__(self, task: Task, output: WorkflowOutput) -> float:
        """The score of `output` as the answer to `task`, in the reward model's own units.

        Raises:
            RuntimeError: the endpoint did not answer 200.
            ValueError: its answer holds no single finite score.
        """
        r = self._http.post(self.url, json={"model": self.model, "messages": conversation(task, output)})
        if r.status_code != 200:
            raise RuntimeError(f"the reward model at {self.url} answered {r.status_code}: {r.text[:300]}")
        return score_of(r.json())

    def close(self) -> None:
        self._http.close()


def conversation(task: Task, output: WorkflowOutput) -> list[dict[str, Any]]:
    """The messages the reward model scores: the request (or the query), then the answer as the assistant's turn."""
    messages = task.metadata.get("messages") or [{"role": "user", "content": task.query}]
    answer = (output.metadata or {}).get("message") or {"role": "assistant", "content": output.final_answer or ""}
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    return [{k: m[k] for k in keep if m.get(k) is not None} for m in [*messages, answer]]


def score_of(body: Any) -> float:
    """The reward in a pooling response (module docstring). Raises ValueError naming what was found instead."""
    try:
        value = body["data"][0]["data"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"the reward model's answer has no data[0].data: {str(body)[:300]}") from None
    if isinstance(value, list) and value and isinstance(value[-1], list):   # one row per token: the last token's
        value = value[-1]
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"the reward model gave {len(value)} values where one score was expected (a classifier "
                             f"with several labels is not a reward model): {str(value)[:200]}")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the reward model's score is not a finite number: {value!r}")
    return float(value)
