"""`ajet init --kind command`: the agent is a plain program (no ajet code), started once per episode."""

import json

SUMMARY = "a program as the agent: agent.py (plain OpenAI SDK, no ajet import) runs once per episode, prints its reward"

CONFIG = """\
# {{project}}: a program trained as it is (written by `ajet init --kind command`). Run from this folder:
#   ajet --conf ajet.yaml --backbone=debug        outputs go to experiments/{{project}}/
# ajet starts agent.py once per episode with the episode's endpoint in OPENAI_BASE_URL / OPENAI_API_KEY and the
# task in AJET_TASK; the program's last line of stdout is its result. Every key is in ajet's configuration
# reference (docs/configuration.md).
experiment_name: {{project}}
workflow:
  # the interpreter that ran `ajet init` (it has the openai package); any program in any language works
  command: [{{python}}, agent.py]
  timeout_s: 300                        # per episode, not counting the time its calls wait for the model
model:
  path: smollm2-135m-instruct           # the bundled SmolLM2-135M-Instruct; or a Hugging Face id or a folder
  max_model_len: 1024
data:
  train_path: tasks.jsonl
rollout:
  num_repeat: 4                         # episodes per task: one GRPO group
  temperature: 0.8
  max_tokens: 24                        # per call
trainer:
  total_steps: 8
  tasks_per_step: 2
algorithm:
  lr: 3.0e-5
"""

AGENT = '''\
"""One episode: ask the model for a country's capital, score the reply, print the result.

ajet runs this program once per episode. It needs no ajet code: the OpenAI SDK reads the episode's endpoint of
ajet's recording proxy from OPENAI_BASE_URL and OPENAI_API_KEY, the model name is in AJET_MODEL, the task is JSON
in AJET_TASK (and on stdin). The last line printed is the result: a JSON object with `reward` (and optionally
`final_answer`, `metrics`), or plain text that the config's judge scores. stderr is kept in the episode record.
"""

import json
import os
import sys

from openai import OpenAI


def score(reply: str, answer: str) -> float:
    """1.0 for the right city alone (at most three words), 0.5 for the right city in a longer reply, else 0.0."""
    if answer.lower() not in reply.lower():
        return 0.0
    return 1.0 if len(reply.split()) <= 3 else 0.5


def main() -> None:
    task = json.loads(os.environ["AJET_TASK"])
    response = OpenAI().chat.completions.create(
        model=os.environ["AJET_MODEL"],
        messages=[{"role": "system", "content": "Reply with the name of the city only."},
                  {"role": "user", "content": task["query"]}])
    reply = (response.choices[0].message.content or "").strip()
    print(f"{task['task_id']}: {reply!r}", file=sys.stderr)
    print(json.dumps({"reward": score(reply, task["answer"]), "final_answer": reply,
                      "metrics": {"reply_words": len(reply.split())}}))


if __name__ == "__main__":
    main()
'''

TASKS = "".join(json.dumps({"task_id": country.lower(), "query": f"What is the capital of {country}?",
                            "answer": city}) + "\n"
                for country, city in [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"),
                                      ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"),
                                      ("Peru", "Lima"), ("Norway", "Oslo")])

FILES = {"ajet.yaml": CONFIG, "agent.py": AGENT, "tasks.jsonl": TASKS}
