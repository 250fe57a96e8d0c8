"""`ajet init --kind chat`: a `Workflow` class that asks the policy one question per episode, and a reward."""

import json

SUMMARY = "a chat agent: a Workflow class (OpenAI SDK) answers arithmetic word problems; a judge scores the number"

CONFIG = """\
# {{project}}: a chat agent trained with GRPO (written by `ajet init --kind chat`). Run from this folder:
#   ajet --conf ajet.yaml --backbone=debug        outputs go to experiments/{{project}}/
# Each step rolls out tasks_per_step tasks x num_repeat episodes; the episodes of a task are one GRPO group.
# Every key is in ajet's configuration reference (docs/configuration.md).
experiment_name: {{project}}
workflow: workflow.py:ChatWorkflow      # one episode (a path relative to this file's folder, or module:Class)
judge: workflow.py:reward               # scores each episode's final answer
model:
  path: smollm2-135m-instruct           # the bundled SmolLM2-135M-Instruct; or a Hugging Face id or a folder
  max_model_len: 1024
data:
  train_path: tasks/train.jsonl
  val_path: tasks/val.jsonl             # held out, never trained on: ajet eval --conf ajet.yaml
rollout:
  num_repeat: 4
  temperature: 0.8
  max_tokens: 64                        # per call
trainer:
  total_steps: 8
  tasks_per_step: 2
  val_freq: 8                           # val/* on the held-out tasks before step 1 and after the last step
algorithm:
  lr: 3.0e-5
"""

WORKFLOW = '''\
"""One episode of the chat agent: the task's question goes to the policy, the reply is the final answer.

`tuner.client` is an `openai.AsyncOpenAI` bound to this episode's endpoint of ajet's recording proxy: every call
is recorded with its exact tokens, and the judge's reward decides which of a task's episodes are reinforced.
"""

from ajet import Task, Tuner, Workflow, WorkflowOutput
from ajet.judges import extract_final_number

SYSTEM_PROMPT = "You are a math assistant. Solve the problem step by step, then end with: The answer is <number>."


class ChatWorkflow(Workflow):
    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        response = await tuner.client.chat.completions.create(
            model=tuner.model,
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.query}])
        answer = response.choices[0].message.content or ""
        return WorkflowOutput(final_answer=answer, metrics={"answer_words": len(answer.split())})


def reward(task: Task, output: WorkflowOutput) -> float:
    """1.0 when the reply's final number is the task's answer; 0.1 for a wrong number in the asked-for form
    ("The answer is ..."), which gives a small model a signal before it gets answers right; else 0.0."""
    if extract_final_number(output.final_answer) == task.answer:
        return 1.0
    return 0.1 if "the answer is" in (output.final_answer or "").lower() else 0.0
'''

def _jsonl(rows: list[tuple[str, str, str]]) -> str:
    return "".join(json.dumps({"task_id": t, "query": q, "answer": a}) + "\n" for t, q, a in rows)


TRAIN = _jsonl([
    ("apples", "Tom has 3 apples and buys 4 more. How many apples does Tom have?", "7"),
    ("pens", "A box holds 12 pens. How many pens are in 3 boxes?", "36"),
    ("stickers", "Sara had 20 stickers and gave away 7. How many stickers does she have left?", "13"),
    ("cookies", "Kai shares 24 cookies equally among 4 friends. How many cookies does each friend get?", "6"),
    ("pages", "Mia reads 15 pages a day. How many pages does she read in 4 days?", "60"),
    ("marbles", "Omar has 9 marbles, wins 6 more and then loses 2. How many marbles does Omar have?", "13"),
    ("seats", "A bus has 40 seats and 28 are taken. How many seats are free?", "12"),
    ("eggs", "A carton holds 6 eggs. How many eggs are in 5 cartons?", "30"),
])
VAL = _jsonl([
    ("val-coins", "Lena has 8 coins and finds 5 more. How many coins does Lena have?", "13"),
    ("val-bags", "Each bag holds 7 oranges. How many oranges are in 4 bags?", "28"),
    ("val-birds", "There are 17 birds on a tree and 9 fly away. How many birds are left?", "8"),
    ("val-pizza", "A pizza has 8 slices. 3 friends eat 2 slices each. How many slices are left?", "2"),
])

FILES = {"ajet.yaml": CONFIG, "workflow.py": WORKFLOW, "tasks/train.jsonl": TRAIN, "tasks/val.jsonl": VAL}
