"""Write tasks/train.jsonl: questions about the shop database whose answers are computed here with SQL.

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


def make_tasks(seed: int = 0) -> list[dict]:
    """Every (template, value) pair once, shuffled with `seed`."""
    db = open_database()
    tasks = []
    for t, (question, answer_sql, values_sql) in enumerate(TEMPLATES):
        for (value,) in db.execute(values_sql).fetchall():
            (answer,) = db.execute(answer_sql, (value,)).fetchone()
            tasks.append({"query": question.format(value), "answer": str(answer)})
    random.Random(seed).shuffle(tasks)
    return [{"task_id": f"shop-{i:03d}", **task} for i, task in enumerate(tasks)]


if __name__ == "__main__":
    out = HERE / "tasks" / "train.jsonl"
    out.parent.mkdir(exist_ok=True)
    rows = make_tasks()
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} tasks to {out}")
