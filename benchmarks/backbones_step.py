"""The main job through two backbones, side by side: reward, held-out val/pass@1 and step time, from the
experiment folders of two real runs with the same config and seed.

    ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone debug --steps 2 --exp-dir /tmp/bb_debug
    .venvs/verl/bin/ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone verl --steps 2 \\
        --exp-dir /tmp/bb_verl
    python benchmarks/backbones_step.py /tmp/bb_debug /tmp/bb_verl

Prints, per run: the training steps, the mean rollout reward over them, val/pass@1 before step 1 and after the
last step, the mean step time (rollout + update, seconds; held-out evaluation excluded) and the mean time
after the rollout (step - rollout: the update and its weight sync); then the step- and update-time ratios of the second run to the first (the named peer).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def summary(exp: Path) -> dict:
    """Figures of one experiment folder (its metrics.jsonl and config.json)."""
    rows = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
    vals = [r for r in rows if "val/pass@1" in r]
    backbone = json.loads((exp / "config.json").read_text()).get("backbone", "?")
    return {"backbone": backbone, "steps": len(steps),
            "reward_mean": statistics.fmean(r["reward/mean"] for r in steps) if steps else float("nan"),
            "val_pass@1_first": vals[0]["val/pass@1"] if vals else float("nan"),
            "val_pass@1_last": vals[-1]["val/pass@1"] if len(vals) > 1 else float("nan"),
            "step_s": statistics.fmean(r["time/step_s"] for r in steps) if steps else float("nan"),
            # everything after the rollout: samples, the update, the weight sync (the same for both backbones)
            "update_s": statistics.fmean(r["time/step_s"] - r["time/rollout_s"] for r in steps) if steps
            else float("nan")}


def main(peer: str, other: str) -> None:
    a, b = summary(Path(peer)), summary(Path(other))
    keys = ["backbone", "steps", "reward_mean", "val_pass@1_first", "val_pass@1_last", "step_s", "update_s"]
    print(f"{'':18}" + "".join(f"{k:>18}" for k in keys))
    for name, s in ((peer, a), (other, b)):
        print(f"{Path(name).name[:18]:18}" + "".join(
            f"{s[k]:>18.4f}" if isinstance(s[k], float) else f"{s[k]:>18}" for k in keys))
    print(f"step time ratio {b['backbone']}/{a['backbone']}: {b['step_s'] / a['step_s']:.2f}x; "
          f"update time ratio: {b['update_s'] / a['update_s']:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
