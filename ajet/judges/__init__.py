"""Judges: `(task, output) -> reward` (sync or async). Name one in the config as `judge: module:NAME`.

    ajet.judges:math_answer_judge        the final number equals task.answer        (math_answer.py)
    ajet.judges:answer_with_tool_use_judge   ... and the answer came after a valid tool call (math_answer.py)
    ajet.judges:countdown_judge          an expression reaching the target           (countdown.py)
    ajet.judges:frozenlake_judge         the environment's reward, from the workflow (frozenlake.py)
    ajet.judges.llm:LLMJudge             a rubric prompt to any OpenAI-compatible model (llm.py)
    ajet.tasks.generator:reasoning_gym_judge   reasoning-gym's own scorer

Any function of your own works the same way (`judge: my_file.py:my_judge`).
"""

from ajet.judges.calling import JudgeError, call_judge, judge_name, set_judge_name
from ajet.judges.countdown import countdown_judge, countdown_score
from ajet.judges.frozenlake import frozenlake_judge
from ajet.judges.math_answer import _normalise, answer_with_tool_use_judge, extract_final_number, math_answer_judge

__all__ = ["JudgeError", "answer_with_tool_use_judge", "call_judge", "countdown_judge", "countdown_score",
           "extract_final_number", "frozenlake_judge", "judge_name", "load_judge", "math_answer_judge", "_normalise"]


def load_judge(cfg):
    """The config's judge: the function `cfg.judge` names, or, when it names a class (e.g.
    `ajet.judges.llm:LLMJudge`), an instance built with the config. None without a judge.

    A judge is called as `judge(task, output)` (or awaited, when it is a coroutine function) for each episode
    whose workflow returned `reward=None` (`call_judge`); the float it returns is the episode's reward. An
    exception it raises, or a value that is not a finite number, fails that episode with a `JudgeError` naming
    the judge by `cfg.judge` (recorded with its traceback, not trained on).

    Raises:
        WorkflowLoadError: the name cannot be imported (or its module raised while importing: one line).
        Exception: whatever the judge class's constructor raises (e.g. ConfigError from `LLMJudge`).
    """
    from ajet.importing import load_object

    if not cfg.judge:
        return None
    judge = load_object(cfg.judge, cfg.config_dir, role="judge")
    judge = judge(cfg) if isinstance(judge, type) else judge
    set_judge_name(judge, cfg.judge)
    return judge
