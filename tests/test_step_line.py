"""The console line each training step prints: generation speed to 3 significant figures (a slow run's
0.43 tok/s used to print as "gen 0 tok/s")."""

from ajet.trainer import _console_line

METRICS = {"rollout/episodes": 8, "rollout/failed": 1, "reward/mean": 0.5, "reward/std": 0.25, "rollout/calls": 12,
           "tracker/samples": 8, "tracker/merge_ratio": 1.5, "tracker/forks": 0, "tracker/token_ratio": 1.4,
           "train/update_s": 2.0, "time/step_s": 30.0}


def gen(tokens_per_s: float) -> str:
    line = _console_line(3, 16, {**METRICS, "rollout/tokens_per_s": tokens_per_s})
    assert line.startswith("step 3/16 | episodes 8 (1 failed) | reward 0.500 ± 0.250 |")
    return line.split("| gen ", 1)[1].split(" tok/s", 1)[0]


def test_generation_speed_has_three_significant_figures():
    assert gen(0.43) == "0.43"
    assert gen(0.4321) == "0.432"
    assert gen(0.004321) == "0.00432"
    assert gen(7.0) == "7"
    assert gen(12.345) == "12.3"
    assert gen(123.456) == "123"
    assert gen(4321.7) == "4322"        # whole tokens from 1000 on, never "4.32e+03"
    assert gen(0.0) == "0"
