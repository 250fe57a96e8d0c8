"""LLM-as-judge: a rubric prompt sent to any OpenAI-compatible model, the score parsed from its reply.

    judge: ajet.judges.llm:LLMJudge
    llm_judge:
      rubric: rubric.txt            # or the text itself; {query}, {answer}, {reference} are filled in
      base_url: null                # null: a frozen copy of the initial policy, served by ajet, never trained
      model: ajet-judge
      max_score: 10

By default the judge is the policy's initial weights (`model.path`, loaded once more and frozen) behind
its own ajet proxy, so judging needs no other server and the judge never drifts with training. Its calls
are recorded by that proxy and discarded: they are never trained on.

The reply is parsed robustly (`parse_score`): "Score: 7", "7/10", "**8**", "rating = 6.5" ... A reply
with no score is not a crash: the episode gets `parse_failure_reward` and the failure is recorded in
`output.metadata["llm_judge"]` and `output.metrics["judge_parse_failed"]`.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ajet.task import Task
from ajet.workflow import WorkflowOutput

if TYPE_CHECKING:
    from ajet.config import AjetConfig

DEFAULT_RUBRIC = (
    "You are grading an assistant's answer.\n"
    "Question: {query}\nReference answer: {reference}\nAssistant's answer: {answer}\n"
    "Give a score from 0 (wrong or unhelpful) to {max_score} (fully correct and helpful). "
    "Reply with one line: Score: N")

# labelled scores first ("score: 7", "rating = 6.5", "7/10", "7 out of 10"), then a lone number on its own line
_LABELLED = re.compile(r"(?:score|rating|grade)\s*(?:is|of)?\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)", re.I)
_FRACTION = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:/|out of)\s*(\d+(?:\.\d+)?)", re.I)
_ALONE = re.compile(r"^\W*(-?\d+(?:\.\d+)?)\W*$", re.M)
# a verdict word opening the reply, for rubrics that ask for yes/no (easier for a small judge than a number)
_VERDICT = re.compile(r"^\W*(yes|no)\b", re.I)


def parse_score(text: str | None, max_score: float) -> float | None:
    """The judge's score in [0, 1] (`score / max_score`, clipped), or None when the reply holds none.

    Tried in order: the last labelled score ("Score: 7", "rating = 6.5"), the last fraction ("7/10", "7 out
    of 10", scaled by its own denominator), the last line that is only a number ("**8**"), and a reply that
    opens with "yes" (1.0) or "no" (0.0).
    """
    if not text:
        return None
    m = _LABELLED.findall(text)
    if m:
        return _clip(float(m[-1]) / max_score)
    f = _FRACTION.findall(text)
    if f and float(f[-1][1]) > 0:
        return _clip(float(f[-1][0]) / float(f[-1][1]))
    a = _ALONE.findall(text)
    if a:
        return _clip(float(a[-1]) / max_score)
    v = _VERDICT.match(text)
    return (1.0 if v.group(1).lower() == "yes" else 0.0) if v else None


def _clip(x: float) -> float:
    return min(1.0, max(0.0, x))


class LLMJudge:
    """`await judge(task, output) -> reward in [0, 1]` asking an OpenAI-compatible model with a rubric
    (LLM-as-a-judge: Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena").

    One call per episode: the rubric (`prompt`) as one user message, `llm_judge.temperature` and
    `llm_judge.max_tokens` (tokens); the reply's score is `parse_score(reply, max_score)` = score /
    max_score clipped to [0, 1], or `llm_judge.parse_failure_reward` when the reply holds no score (recorded
    in `output.metadata["llm_judge"]` and `output.metrics["judge_parse_failed"]`).

    Args:
        cfg: the experiment config; its `llm_judge` section (see `ajet.config.LLMJudgeConfig`) says which
            endpoint, model, rubric (a file path, relative to the config's folder, or the text) and score
            scale. With `base_url` None the frozen initial policy is started on first use (`FrozenPolicy`).

    Raises:
        openai.APIError: (when judging) the judge's endpoint failed after 2 retries; the episode fails.
        OSError: (when judging with the frozen policy) its model cannot be loaded.
    """

    def __init__(self, cfg: AjetConfig):
        self.cfg, self.j = cfg, cfg.llm_judge
        rubric = self.j.rubric or DEFAULT_RUBRIC
        p = Path(rubric) if len(rubric) < 300 and "\n" not in rubric else None
        if p is not None and cfg.config_dir is not None and not p.is_absolute():
            p = cfg.config_dir / p
        self.rubric = p.read_text() if p is not None and p.is_file() else rubric
        self._frozen: FrozenPolicy | None = None
        self._lock = threading.Lock()

    def prompt(self, task: Task, output: WorkflowOutput) -> str:
        """The rubric with {query}, {answer}, {reference}, {max_score} filled in."""
        return self.rubric.replace("{query}", task.query).replace("{answer}", output.final_answer or "") \
            .replace("{reference}", task.answer or "(none)").replace("{max_score}", f"{self.j.max_score:g}")

    async def __call__(self, task: Task, output: WorkflowOutput) -> float:
        """The episode's reward in [0, 1] (see the class docstring); records the reply in `output.metadata`.

        Raises:
            openai.APIError: the judge's endpoint failed after 2 retries.
        """
        from openai import AsyncOpenAI

        from ajet.tls import openai_http_client

        messages = [{"role": "user", "content": self.prompt(task, output)}]
        endpoint = None
        if self.j.base_url:
            client = AsyncOpenAI(base_url=self.j.base_url, api_key=self.j.api_key or "none", max_retries=2,
                                 http_client=openai_http_client())
        else:
            with self._lock:
                if self._frozen is None:
                    self._frozen = FrozenPolicy(self.cfg)
            endpoint = self._frozen.proxy.open_episode(f"judge-{id(output)}")
            client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=2,
                                 http_client=openai_http_client())
        try:
            r = await client.chat.completions.create(model=self.j.model, messages=messages,
                                                     temperature=self.j.temperature, max_tokens=self.j.max_tokens)
            reply = r.choices[0].message.content or ""
        finally:
            await client.close()
            if endpoint is not None:
                self._frozen.proxy.close_episode(endpoint)   # the judge's calls are never trained on
        score = parse_score(reply, self.j.max_score)
        record: dict[str, Any] = {"reply": reply, "score": score}
        if score is None:
            record["parse_error"] = "no score found in the judge's reply"
        output.metadata["llm_judge"] = record
        output.metrics["judge_parse_failed"] = float(score is None)
        return self.j.parse_failure_reward if score is None else score


class FrozenPolicy:
    """The initial policy (`cfg.model.path`), loaded once more and never trained, behind its own ajet proxy
    (greedy unless `llm_judge.temperature` > 0). Its threads are daemons: they end with the process."""

    def __init__(self, cfg: AjetConfig):
        from ajet.engines.in_process import HFEngine
        from ajet.llm_call import SamplingParams
        from ajet.model import load_model, load_tokenizer, resolve_model_path
        from ajet.proxy.server import ProxyServer

        path = resolve_model_path(cfg.llm_judge.frozen_model_path or cfg.model.path)
        self.tokenizer = load_tokenizer(path, cfg.model.chat_template)
        model = load_model(path, cfg.model.dtype, cfg.model.device).eval().requires_grad_(False)
        eos = sorted({self.tokenizer.eos_token_id} | _generation_eos(model))
        self.engine = HFEngine(model, eos, self.tokenizer.pad_token_id, max_model_len=cfg.model.max_model_len,
                               decode_fn=self.tokenizer.decode)
        params = SamplingParams(temperature=cfg.llm_judge.temperature, max_tokens=cfg.llm_judge.max_tokens)  # 0: greedy
        self.proxy = ProxyServer(self.engine, self.tokenizer, params, max_model_len=cfg.model.max_model_len,
                                 model_name=cfg.llm_judge.model).start()


def _generation_eos(model) -> set[int]:
    g = getattr(model.generation_config, "eos_token_id", None) if model.generation_config is not None else None
    return set() if g is None else set(g if isinstance(g, list) else [g])
