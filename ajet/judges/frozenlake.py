"""FrozenLake (gymnasium `FrozenLake-v1`): the environment's own reward is 1 for reaching the goal and 0
otherwise. The workflow plays the episode and reports what the environment said in its metrics."""

from __future__ import annotations

from ajet.task import Task

# per action the model wrote that the game could not parse: a small penalty, so that among episodes that all
# fail to reach the goal GRPO still prefers the ones that speak the action format
INVALID_ACTION_PENALTY = 0.1


def frozenlake_judge(task: Task, output) -> float:
    """`metrics["success"]` (the environment's reward: 1 at the goal, 0 in a hole or out of turns; gymnasium's
    `FrozenLake-v1`) minus INVALID_ACTION_PENALTY (0.1) for each unparseable action
    (`metrics["invalid_actions"]`), floored at -0.5: a reward in [-0.5, 1]. Missing metrics count as 0.

    Raises:
        ValueError, TypeError: a metric that is not a number.
    """
    m = output.metrics
    return max(-0.5, float(m.get("success", 0.0)) - INVALID_ACTION_PENALTY * float(m.get("invalid_actions", 0)))
