"""One user of `ajet gateway`: asks arithmetic word problems with the unmodified OpenAI SDK, checks each answer,
closes the conversation and sends the feedback (1.0 right, 0.0 wrong). Nothing here imports ajet.

    python tutorial/example_live_gateway/client.py [--base-url http://127.0.0.1:8766] [--n 3] [--stream]

The api key is `--api-key`, else $AJET_SECRET, else "none" (a gateway on 127.0.0.1 without a secret takes any
key). The questions are the math tutorial's training problems (../example_math_agent/tasks/train.jsonl). Each
problem prints one JSON line: the session and response ids, the policy version that answered, the answer, the
reward sent and the gateway's reply to it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

import httpx
from openai import OpenAI

QUESTIONS = Path(__file__).resolve().parent.parent / "example_math_agent" / "tasks" / "train.jsonl"
SYSTEM = "You are a math assistant. Answer the question, then end with: The answer is N."


def last_number(text: str) -> str | None:
    """The last number in `text` ("... The answer is 17." -> "17"; "3.50" -> "3.5"), or None."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    if not numbers:
        return None
    value = float(numbers[-1])
    return str(int(value)) if value.is_integer() else str(value)


def ask(client: OpenAI, question: str, stream: bool) -> tuple[str, str, str, str | None]:
    """One conversation of one turn: (answer text, session id, response id, policy version or None).

    The gateway names the session and the response in the headers (`X-Ajet-Session`, `X-Ajet-Response-Id`); a
    non-streamed answer also carries `X-Ajet-Policy-Version` (a stream's version is in GET /v1/sessions/{id})."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    raw = client.chat.completions.with_raw_response.create(model="ajet-policy", messages=messages, stream=stream)
    session, response_id = raw.headers["x-ajet-session"], raw.headers["x-ajet-response-id"]
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    return text, session, response_id, raw.headers.get("x-ajet-policy-version")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8766", help="the gateway (without /v1)")
    p.add_argument("--api-key", default=os.environ.get("AJET_SECRET", "none"))
    p.add_argument("--n", type=int, default=3, help="problems to ask")
    p.add_argument("--stream", action="store_true", help="stream the answers")
    p.add_argument("--seed", type=int, default=None, help="which problems (default: random)")
    args = p.parse_args()

    tasks = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key)
    gateway = httpx.Client(base_url=args.base_url, headers={"Authorization": f"Bearer {args.api_key}"}, timeout=60)
    for task in random.Random(args.seed).sample(tasks, args.n):
        answer, session, response_id, version = ask(client, task["query"], args.stream)
        reward = 1.0 if last_number(answer) == task["answer"] else 0.0
        gateway.post(f"/v1/sessions/{session}/close").raise_for_status()   # this conversation is over
        ack = gateway.post("/v1/feedback", json={"session_id": session, "reward": reward,
                                                 "comment": f"expected {task['answer']}"})
        ack.raise_for_status()                         # 200: durable in gateway.sqlite
        print(json.dumps({"session_id": session, "response_id": response_id, "policy_version": version,
                          "question": task["query"], "answer": answer, "expected": task["answer"],
                          "reward": reward, "feedback": ack.json()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
