"""The training loop (`trainer:`, with `trainer.async`), held-out evaluation (`eval:`) and `sft:`."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from ajet.config.base import _Section


LoggerName = Literal["console", "tensorboard", "jsonl", "wandb"]
# loggers whose package is not a core dependency: the extra that installs it
_LOGGER_EXTRAS = {"wandb": "wandb"}


def _package_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


class AsyncConfig(_Section):
    """Asynchronous (off-policy) training, `trainer.async`: the rollout source keeps producing episodes while the
    backbone updates (as in verl's fully async trainer, AReaL, Agent Lightning, TRL async GRPO).

    max_staleness: K, in policy versions. Unset (None, the default): today's loop (the in-process and command
    sources roll a step out only after the previous update, i.e. K = 0; `ajet serve` trains what its clients
    finished, however old). K >= 0: the in-process and command sources start step t's episodes once step
    t - 1 - K is trained (episodes of later steps keep running across updates and carry over); with every
    source, a sample holding a token sampled by a policy more than K versions older than the one the update
    starts from is dropped, never trained, and counted (`async/stale_samples`).
    is_cap: with K > 0, the PPO loss is corrected token by token for the gap between the behaviour policy (the
    engine's logprobs) and the policy the update starts from, by min(pi_prox / pi_behaviour, is_cap)
    (truncated importance sampling; see `ajet.algorithm.loss.truncated_is_weights`; verl's `rollout_is_threshold`).
    """

    max_staleness: int | None = Field(None, ge=0, description="K, in policy versions: None keeps the synchronous "
                                                              "loop; K >= 0 lets rollout run up to K versions ahead "
                                                              "of the update and drops samples holding a token "
                                                              "sampled more than K versions before it")
    is_cap: float = Field(2.0, gt=0, description="with K > 0: the cap of the per-token importance weight min(pi_prox "
                                                 "/ pi_behaviour, is_cap)")


class TrainerConfig(_Section):
    """The training loop. tasks_per_step tasks x num_repeat episodes are rolled out per step.

    loggers: where per-step metrics go. console: the step line and progress bar; tensorboard:
    `exp_dir/tensorboard` (also off with `tensorboard: false`); jsonl: `exp_dir/metrics.jsonl` (what the plots
    and `ajet view` chart); wandb: Weights & Biases, offline under `exp_dir/wandb` unless WANDB_API_KEY (or
    WANDB_MODE=online) is set, with a table of each step's episodes (`pip install 'ajet[wandb]'`).
    """

    total_steps: int = Field(10, ge=1, description="training steps (one update each) in the run; the CLI's --steps "
                                                   "sets it")
    tasks_per_step: int = Field(4, ge=1, description="tasks (GRPO groups) per step, each rolled out "
                                                     "rollout.num_repeat times")
    save_freq: int = Field(0, ge=0, description="checkpoint every N steps; 0 = only at the end")
    seed: int = Field(0, description="the run's seed: Python's and torch's RNGs, the task order, and each call's "
                                     "sampler (seeded with the episode and the call index); the CLI's --seed sets it")
    exp_dir: str = Field(
        "experiments/{experiment_name}", description="the experiment folder (`{experiment_name}` is filled in; "
                                                     "relative to the cwd); the CLI's --exp-dir sets it")
    tensorboard: bool = Field(True, description="False turns the tensorboard logger off even when `loggers` lists it")
    loggers: list[LoggerName] = Field(
        default_factory=lambda: ["console", "tensorboard", "jsonl"], description="where per-step metrics go: console,"
                                                                                 " tensorboard (exp_dir/tensorboard),"
                                                                                 " jsonl (exp_dir/metrics.jsonl), "
                                                                                 "wandb (`pip install 'ajet[wandb]'`;"
                                                                                 " offline under exp_dir/wandb unless"
                                                                                 " WANDB_API_KEY is set)")
    plots: bool = Field(True, description="draw exp_dir/plots/*.png at the end of the run (matplotlib: about 2 s of "
                                          "CPU); the environment variable AJET_PLOTS (0 or 1) overrides it; "
                                          "`python -m ajet.viewer.plots EXP_DIR` draws them at any time")
    save_trajectories: bool = Field(True, description="write every episode (calls with token ids and logprobs, "
                                                      "samples, reward) to exp_dir/trajectories.jsonl")
    resume: bool = Field(False, description="continue from the newest checkpoint in exp_dir (CLI: --resume)")
    progress: bool = Field(True, description="show the progress of evaluations, rollouts, updates and checkpoint "
                                             "writes: a live display on a terminal, else one line per phase every "
                                             "progress_interval_s; false (or the CLI's --quiet) shows none")
    progress_interval_s: float = Field(30.0, gt=0, description="seconds between two progress lines of a phase when "
                                                               "stdout is not a terminal (the environment variable "
                                                               "AJET_PROGRESS_INTERVAL_S overrides it)")
    max_failed_steps: int = Field(3, ge=1, description="stop after this many steps in a row with no usable episode")
    val_freq: int = Field(0, ge=0, description="evaluate the validation set (data.val_path) at step 0, every N "
                                               "steps and at the last step (logged as val/*); 0 = never")
    val_before_train: bool = Field(True, description="evaluate the validation set (with val_freq) and the test set "
                                                     "(data.test_path) before step 1 too (logged at step 0; verl's "
                                                     "name); false skips both, e.g. for many seeds of one model, "
                                                     "whose initial score `ajet eval` measures once")
    keep_best: bool | None = Field(None, description="end the run with the checkpoint of the best validation score "
                                                     "(best_metric), the initial model (step 0) included, instead "
                                                     "of the last step's; None: on when the run validates "
                                                     "(val_freq > 0), except in mode gateway")
    best_metric: str = Field("val/pass@1",
                             description="the validation metric keep_best compares: a val/* key of metrics.jsonl, "
                                         "e.g. val/pass@1, val/reward_mean, val/workflow/<name>")
    best_mode: Literal["max", "min"] = Field("max", description="max: the highest best_metric wins; min: the "
                                                                "lowest; a tie keeps the earlier step")
    stop_on_invalid_eval: bool = Field(True, description="stop the run (exit status 2) when the held-out "
                                                         "evaluation before step 1 is invalid (more than "
                                                         "eval.max_failed_frac of its episodes failed); false "
                                                         "trains on, the evaluation reported as INVALID")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async",
                                description="asynchronous training with bounded staleness (YAML key `async`)")

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @field_validator("loggers")
    @classmethod
    def _loggers_installed(cls, loggers: list[str]) -> list[str]:
        missing = [name for name in loggers if name in _LOGGER_EXTRAS and _package_missing(name)]
        if missing:
            raise ValueError(f"logger {missing[0]!r} needs its package: pip install 'ajet[{_LOGGER_EXTRAS[missing[0]]}]' "
                             f"(or remove it from trainer.loggers)")
        return list(dict.fromkeys(loggers))

    @field_validator("best_metric")
    @classmethod
    def _best_metric_is_validation(cls, name: str) -> str:
        if not name.startswith("val/") or len(name) == len("val/") or any(c.isspace() for c in name):
            raise ValueError("must name a validation metric, a val/* key of metrics.jsonl such as val/pass@1 or "
                             "val/reward_mean")
        return name

    def active_loggers(self) -> list[str]:
        """`loggers`, without tensorboard when `tensorboard: false`."""
        return [name for name in self.loggers if self.tensorboard or name != "tensorboard"]


class EvalConfig(_Section):
    """Held-out evaluation (`ajet eval`, and `trainer.val_freq` during training; see ajet/eval.py).

    n episodes per task; temperature 0 is greedy decoding (the argmax token; then n > 1 repeats the same
    answer up to batching numerics). An episode passes when its reward >= pass_threshold.
    """

    n: int = Field(1, ge=1, description="episodes per task (the k of pass@k)")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold of evaluation episodes, in (0, 1]")
    pass_threshold: float = Field(1.0, description="reward at or above which an episode counts as solved")
    max_failed_frac: float = Field(
        0.05, ge=0, le=1, description="an evaluation in which a larger share of the episodes failed (raised or timed "
                                      "out) is reported as invalid: val/valid 0 (`valid` in eval_metrics.json), no "
                                      "score logged, the console says why; `ajet eval` exits with status 1")


class SftConfig(_Section):
    """Supervised fine-tuning on a finished run's recorded samples (`ajet sft`; docs/sft.md): the trainer replays
    the samples of `from_dir` (their exact tokens and loss masks; no generation) and the backbone's update
    minimises the token-level cross-entropy on their loss-mask-1 tokens (mean over tokens) instead of the RL loss.
    With `min_reward` it is rejection-sampling fine-tuning. `algorithm.lr`, `mini_batches`, `micro_batch_tokens`
    and `max_grad_norm` apply; `trainer.total_steps` counts updates."""

    from_dir: str = Field(description="the finished run's experiment folder (its trajectories.sqlite, else "
                                      "trajectories.jsonl), relative to the working directory; CLI: --from")
    min_reward: float | None = Field(None, description="keep only the episodes whose reward is at least this "
                                                       "(rejection sampling); None: every successful episode; "
                                                       "CLI: --min-reward")
    agent: str | None = Field(None, description="keep only the samples of this agent tag; None: every agent; "
                                                "CLI: --agent")
    episodes_per_step: int | None = Field(None, ge=1, description="kept episodes per update, in recorded order, "
                                          "starting over after the last; None: all of them, so each step is one "
                                          "pass (epoch) over the kept samples")
