"""Rounds of the guessing game: a secret animal and 4 candidates (the secret among them, in random order).
256 training rounds and 64 held-out rounds; no held-out (secret, candidates) set is a training one.

    python tutorial/example_guessing_game/make_tasks.py     # writes tasks/train.jsonl and tasks/val.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ANIMALS = ["cat", "dog", "fish", "bird", "horse", "cow", "lion", "snake", "frog", "bee", "duck", "whale"]


def make_rounds(n: int, seed: int, exclude: set[tuple] = frozenset()) -> list[dict]:
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < n:
        candidates = rng.sample(ANIMALS, 4)
        secret = rng.choice(candidates)
        key = (secret, tuple(sorted(candidates)))
        if key in seen:
            continue
        seen.add(key)
        rows.append({"query": f"secret: {secret}; candidates: {', '.join(candidates)}", "secret": secret,
                     "candidates": candidates})
    return rows


def main() -> None:
    out = Path(__file__).resolve().parent / "tasks"
    out.mkdir(exist_ok=True)
    train = make_rounds(256, 0)
    val = make_rounds(64, 1, exclude={(r["secret"], tuple(sorted(r["candidates"]))) for r in train})
    for name, rows in (("train", train), ("val", val)):
        with open(out / f"{name}.jsonl", "w") as f:
            for i, row in enumerate(rows):
                f.write(json.dumps({"task_id": f"{name}-{i}", **row}) + "\n")


if __name__ == "__main__":
    main()
