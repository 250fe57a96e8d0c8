"""FrozenLake maps for the tutorial: every distinct solvable 3x3 board that gymnasium's `generate_random_map`
draws (51 of them), split 36 for training and 15 held out: no held-out board is a training board.

    python tutorial/example_frozenlake/make_tasks.py     # writes tasks/train.jsonl and tasks/val.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SIZE, FROZEN_P, SEEDS, N_VAL = 3, 0.7, 2000, 15


def distinct_maps() -> list[list[str]]:
    """The distinct boards drawn from seeds 0..SEEDS-1, in a fixed shuffled order."""
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    maps = {"/".join(generate_random_map(size=SIZE, p=FROZEN_P, seed=s)) for s in range(SEEDS)}
    keys = sorted(maps)
    random.Random(0).shuffle(keys)
    return [k.split("/") for k in keys]


def main() -> None:
    out = Path(__file__).resolve().parent / "tasks"
    out.mkdir(exist_ok=True)
    maps = distinct_maps()
    for name, part in (("train", maps[N_VAL:]), ("val", maps[:N_VAL])):
        with open(out / f"{name}.jsonl", "w") as f:
            for i, desc in enumerate(part):
                f.write(json.dumps({"task_id": f"{name}-{i}", "query": "/".join(desc), "desc": desc}) + "\n")


if __name__ == "__main__":
    main()
