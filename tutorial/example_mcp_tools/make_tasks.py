"""Write tasks/train.jsonl and tasks/val.jsonl: questions about the shop database whose answers are computed here
with SQL. The held-out set (val.jsonl) has HELD_OUT questions of each template, about values no training question
asks about with that template.

    python make_tasks.py

Each task is {"task_id", "query", "answer"}; the answer is a whole number, so `ajet.judges:math_answer_judge`
(inside `answer_with_tool_use_judge`) checks it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from sqlite_server import open_database

HERE = Path(__file__).resolve().parent

# (question template, SQL computing the answer, SQL listing the values for the template's slot)
TEMPLATES = [
    ("How many customers live in {}?", "SELECT COUNT(*) FROM customers WHERE city = ?",
     "SELECT DISTINCT city FROM customers"),
    ("What is the price of {}?", "SELECT price FROM products WHERE name = ?", "SELECT name FROM products"),
    ("How many orders did {} place?",
     "SELECT COUNT(*) FROM orders JOIN customers ON customers.id = orders.customer_id WHERE customers.name = ?",
     "SELECT name FROM customers"),
    ("How many units of {} were ordered in total?",
     "SELECT COALESCE(SUM(quantity), 0) FROM orders JOIN products ON products.id = orders.product_id "
     "WHERE products.name = ?", "SELECT name FROM products"),
]


HELD_OUT = 3     # questions per template in the held-out set


def make_tasks(seed: int = 0) -> list[dict]:
    """Every (template, value) pair once, shuffled with `seed`: the training and the held-out questions together."""
    train, held_out = make_splits(seed)
    return sorted(train + held_out, key=lambda t: t["task_id"])


def make_splits(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(training tasks, held-out tasks): of each template's questions, shuffled with `seed`, the last `HELD_OUT` are
    held out. Task ids number all the questions in one shuffled order."""
    db = open_database()
    rng = random.Random(seed)
    tasks, held = [], set()
    for question, answer_sql, values_sql in TEMPLATES:
        values = [value for (value,) in db.execute(values_sql).fetchall()]
        rng.shuffle(values)
        for i, value in enumerate(values):
            (answer,) = db.execute(answer_sql, (value,)).fetchone()
            tasks.append({"query": question.format(value), "answer": str(answer)})
            if i >= len(values) - HELD_OUT:
                held.add(tasks[-1]["query"])
    rng.shuffle(tasks)
    tasks = [{"task_id": f"shop-{i:03d}", **task} for i, task in enumerate(tasks)]
    return [t for t in tasks if t["query"] not in held], [t for t in tasks if t["query"] in held]


if __name__ == "__main__":
    (HERE / "tasks").mkdir(exist_ok=True)
    for name, rows in zip(("train", "val"), make_splits()):
        out = HERE / "tasks" / f"{name}.jsonl"
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} tasks to {out}")
