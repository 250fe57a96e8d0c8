"""`RemoteTeacher`: an on-policy distillation teacher behind an OpenAI-compatible completions server.

The teacher scores the student's own token ids, never text: each sequence goes out as `"prompt": [ids]` with
vLLM's `prompt_logprobs` extension (`"prompt_logprobs": 0`: the logprob of each prompt token, no alternatives)
and `max_tokens: 1`, and the answer's `choices[0].prompt_logprobs[t]` (None at t = 0, else `{"<id>": {"logprob":
x, ...}}` with the prompt's own id among the keys) gives log pi_teacher(ids[t] | ids[:t]). vLLM's OpenAI server
serves this for any model it serves (`vllm serve TEACHER`), and the teacher must share the student's tokenizer.

What the logprobs are: vLLM computes prompt logprobs from the raw model (temperature 1, no top_p), whatever the
request's sampling parameters (vLLM pull requests #37082 and #47680 are about changing that). A local teacher
(`algorithm.distill.teacher: FOLDER`) is scored under the rollout's temperature and top_p instead; with
`rollout.temperature: 1` and `top_p: 1` the two are the same distribution (tests/test_remote_teacher.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx


class RemoteTeacher:
    """Scores token sequences with a server's prompt logprobs (vLLM's `prompt_logprobs`).

    Args:
        base_url: the server's OpenAI base URL, e.g. "http://10.0.0.2:8000/v1" (requests go to
            `base_url + "/completions"`).
        model: the served model name; None asks `base_url + "/models"` once and takes the first.
        timeout_s: limit for one request, seconds.
        max_connections: requests in flight at once (one per sequence).
    """

    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 8) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self._http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections))
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        r = self._http.get(f"{self.base_url}/models")
        served = r.json().get("data") if r.status_code == 200 else None
        if not served:
            raise RuntimeError(f"distillation teacher {self.base_url}: GET /models answered {r.status_code} "
                               f"{r.text[:200]!r}; set algorithm.distill.teacher_model to the served model name")
        return served[0]["id"]

    def score(self, input_ids: list[int], start: int) -> list[float]:
        """log pi_teacher(input_ids[t] | input_ids[:t]) for t in [start, len(input_ids)), natural log, temperature 1.

        Args:
            input_ids: `[seq]` the whole sequence (prompt + response ids); start: the first position scored (>= 1).

        Returns:
            `[seq - start]` logprobs.

        Raises:
            ValueError: `start` outside [1, seq].
            RuntimeError: the server answered an error, or no `prompt_logprobs` (it does not speak vLLM's extension),
                or a position without the sequence's own token.
        """
        if not 1 <= start <= len(input_ids):
            raise ValueError(f"start must be in [1, {len(input_ids)}], got {start}")
        r = self._http.post(f"{self.base_url}/completions", json={
            "model": self.model, "prompt": list(input_ids), "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0})
        if r.status_code != 200:
            raise RuntimeError(f"distillation teacher {self.base_url}: {r.status_code} {r.text[:300]!r}")
        scored = (r.json().get("choices") or [{}])[0].get("prompt_logprobs")
        if not isinstance(scored, list) or len(scored) != len(input_ids):
            raise RuntimeError(f"distillation teacher {self.base_url} returned no prompt_logprobs for a "
                               f"{len(input_ids)}-token prompt: the server must support vLLM's `prompt_logprobs` "
                               f"(vLLM's OpenAI server does)")
        out = []
        for t in range(start, len(input_ids)):
            entry = (scored[t] or {}).get(str(input_ids[t]))
            if entry is None:
                raise RuntimeError(f"distillation teacher {self.base_url}: prompt_logprobs[{t}] lacks the token "
                                   f"{input_ids[t]}")
            value = float(entry["logprob"])
            out.append(float("-inf") if value <= -9999.0 else value)   # vLLM sends -inf as -9999.0
        return out

    def score_many(self, rows: list[tuple[list[int], int]]) -> list[list[float]]:
        """`score` of each (input_ids, start), `max_connections` at a time; results in the order of `rows`."""
        with ThreadPoolExecutor(max_workers=self.max_connections) as pool:
            return list(pool.map(lambda row: self.score(*row), rows))

    def close(self) -> None:
        self._http.close()
