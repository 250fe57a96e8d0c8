"""Underspecified requests for the learn-to-ask tutorial: a template with one detail left out; the reference
answer names that detail. 192 training and 64 held-out requests, no held-out request text in training.

    python tutorial/example_learn_to_ask/make_tasks.py     # writes tasks/train.jsonl and tasks/val.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# (request with the detail left out, the missing detail, values that fill the other slots)
TEMPLATES = [
    ("Book me a flight to {city}.", "the travel date", {"city": ["Paris", "Tokyo", "Rome", "Cairo", "Lima", "Oslo"]}),
    ("Reserve a table for {n} people tonight.", "which restaurant", {"n": ["2", "3", "4", "5", "6"]}),
    ("Order a {size} pizza for me.", "the toppings", {"size": ["small", "medium", "large"]}),
    ("Set an alarm for tomorrow.", "the time", {}),
    ("Send a message to {name}.", "what the message should say", {"name": ["Tom", "Sara", "Ali", "Mia", "Ben"]}),
    ("Buy {n} tickets for the concert.", "which concert date", {"n": ["1", "2", "3", "4"]}),
    ("Convert {amount} dollars.", "the target currency", {"amount": ["10", "50", "100", "250", "900"]}),
    ("What's the weather like?", "the location", {}),
    ("Book a hotel in {city} for {n} nights.", "the check-in date", {"city": ["Paris", "Tokyo", "Rome", "Berlin"],
                                                                     "n": ["2", "3", "5"]}),
    ("Schedule a meeting with {name}.", "the meeting time", {"name": ["Tom", "Sara", "Ali", "Mia", "Ben"]}),
    ("Translate this sentence for me: '{s}'", "the target language", {"s": ["good morning", "thank you",
                                                                              "where is the station"]}),
    ("Rent a car in {city}.", "the rental dates", {"city": ["Lisbon", "Madrid", "Denver", "Sydney"]}),
]
STYLES = ["{r}", "Hi! {r}", "Please help. {r}", "{r} Thanks.", "Hey, {r}", "Could you do this: {r}"]


def all_requests() -> list[dict]:
    """Every (template, slot values, style) combination, in a fixed shuffled order."""
    import itertools

    rows = []
    for ti, (template, missing, slots) in enumerate(TEMPLATES):
        names = sorted(slots)
        for values in itertools.product(*(slots[k] for k in names)):
            request = template.format(**dict(zip(names, values)))
            for style in STYLES:
                rows.append({"query": style.format(r=request), "answer": missing, "template": ti})
    random.Random(0).shuffle(rows)
    return rows


def main() -> None:
    out = Path(__file__).resolve().parent / "tasks"
    out.mkdir(exist_ok=True)
    rows = all_requests()
    for name, part in (("val", rows[:64]), ("train", rows[64:256])):
        with open(out / f"{name}.jsonl", "w") as f:
            for i, row in enumerate(part):
                f.write(json.dumps({"task_id": f"{name}-{i}", **row}) + "\n")


if __name__ == "__main__":
    main()
