"""Deterministic generator of short arithmetic word problems for the math-agent tutorial.

Sized for a 135M model: mostly one-step additions and subtractions of numbers up to 10, some
multiplications of small numbers and a few two-step problems, so SmolLM2-135M-Instruct solves a few at
step 0 (GRPO needs reward variance within a group) and has room to improve.

    python tutorial/example_math_agent/make_tasks.py     # rewrites tasks/train.jsonl, test.jsonl and val.jsonl

Three disjoint sets (no question text in two of them), each from its own seed of the generator:

    train.jsonl  512 problems (seed 0)  what the run trains on
    test.jsonl   160 problems (seed 1)  the reported figure: evaluated before step 1 and once at the end, on the
                                        run's final model; never used for a decision
    val.jsonl     64 problems (seed 2)  the validation set: evaluated during the run (`trainer.val_freq`) to pick
                                        the checkpoint the run ends with (`trainer.keep_best`)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Tom", "Sara", "Ali", "Mia", "Ben", "Lina", "Omar", "Emma", "Kai", "Zoe"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "coins", "shells"]


def make_problem(rng: random.Random) -> tuple[str, int]:
    """One (question, integer answer) pair."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choices(["add", "sub", "mul", "two_step"], weights=[5, 3, 1, 1])[0]
    if kind == "add":
        a, b = rng.randint(1, 10), rng.randint(1, 10)
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    if kind == "sub":
        a = rng.randint(3, 10)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", a - b
    if kind == "mul":
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        return f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?", a * b
    a, b, c = rng.randint(2, 15), rng.randint(2, 15), rng.randint(1, 10)
    return (f"{name} has {a} {item}, buys {b} more and then gives away {c}. "
            f"How many {item} does {name} have now?", a + b - c)


def make_tasks(n: int, seed: int, prefix: str, exclude: set[str] = frozenset()) -> list[dict]:
    """`n` problems drawn with `seed`, skipping any whose question text is in `exclude`."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        question, answer = make_problem(rng)
        if question not in exclude:
            rows.append({"task_id": f"{prefix}-{len(rows)}", "query": question, "answer": str(answer)})
    return rows


def splits() -> dict[str, list[dict]]:
    """The three sets by name: train (512, seed 0), test (160, seed 1, no question of train) and val (64, seed 2,
    no question of train or test)."""
    train = make_tasks(512, 0, "train")
    test = make_tasks(160, 1, "test", exclude={row["query"] for row in train})
    val = make_tasks(64, 2, "val", exclude={row["query"] for row in train + test})
    return {"train": train, "test": test, "val": val}


def main() -> None:
    """Write tasks/train.jsonl, tasks/test.jsonl and tasks/val.jsonl (see the module docstring)."""
    out = Path(__file__).resolve().parent / "tasks"
    out.mkdir(exist_ok=True)
    for name, rows in splits().items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
