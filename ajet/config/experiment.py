"""The whole experiment: `AjetConfig`, the root of every section, and the checks across sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from ajet.config.algorithm import AlgorithmConfig
from ajet.config.base import _Section, describe
from ajet.config.data import ONE_TASK_SOURCE, DataConfig
from ajet.config.engine import EngineConfig
from ajet.config.model import AGENT_NAME, AgentConfig, ModelConfig
from ajet.config.rollout import ProxyConfig, RolloutConfig
from ajet.config.serving import GATEWAY_ESTIMATOR, GatewayConfig, ServeConfig
from ajet.config.tools import ToolsConfig
from ajet.config.trainer import EvalConfig, SftConfig, TrainerConfig
from ajet.config.workflow import (CommandWorkflowConfig, HarnessSpec, HarnessWorkflowConfig, LLMJudgeConfig,
                                  RewardModelConfig)
from ajet.errors import ConfigError

Mode = Literal["train", "eval", "serve", "gateway", "sft"]
"""The commands a config is checked for (`AjetConfig.mode`)."""

TASK_MODES = ("train", "eval", "serve")
"""The modes that read tasks: their config names one task source (`data`); gateway and sft read none."""


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
    mode: Mode = Field("train", exclude=True, description="not a YAML key: the command the config is checked for "
                       "(`load_config(..., mode=)`, `for_mode`): `train`, `eval`, `serve`, `gateway` or `sft`; "
                       "the checks and defaults only a command needs apply in its mode (e.g. a non-loopback "
                       "`gateway.host` without a secret is refused in mode gateway only; a task source is needed "
                       "in the modes that read tasks, TASK_MODES)")

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

    @model_validator(mode="before")
    @classmethod
    def _data_optional(cls, data: Any) -> Any:
        """Modes that read no tasks (gateway, sft): a config without `data` gets an empty section (no task source)."""
        if isinstance(data, dict) and data.get("mode", "train") not in TASK_MODES and data.get("data") is None:
            return {**data, "data": {}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _mode_defaults(cls, data: Any) -> Any:
        """Modes serve and gateway: the defaults their servers resolve, at validation (never set on a loaded
        config; a section given as a model is copied, not changed).

        `proxy.host` is `serve.host` (mode serve) or `gateway.host` (mode gateway): the proxy answers behind that
        server's address. Mode gateway, `algorithm.adv_estimator` when the config leaves it unset: `grpo` with
        best-of-N (`gateway.n` > 1: each request's candidates share a prompt), else GATEWAY_ESTIMATOR
        (`reinforce_plus_plus`: live sessions have no same-prompt groups)."""
        if not isinstance(data, dict) or data.get("mode") not in ("serve", "gateway"):
            return data
        server = ServeConfig if data["mode"] == "serve" else GatewayConfig
        try:
            s = server.model_validate(data.get(data["mode"]) or {})
        except ValidationError:
            return data                           # reported by the section's own validation
        resolved = [("proxy", ProxyConfig, "host", s.host, False)]
        if isinstance(s, GatewayConfig):
            resolved.append(("algorithm", AlgorithmConfig, "adv_estimator", "grpo" if s.n > 1 else GATEWAY_ESTIMATOR,
                             True))
        data = dict(data)
        for key, model, field, value, unset_only in resolved:
            section = data.get(key) or {}
            if isinstance(section, dict) and (field not in section or not unset_only):
                data[key] = {**section, field: value}
            elif isinstance(section, model) and (field not in section.model_fields_set or not unset_only) \
                    and getattr(section, field) != value:
                data[key] = section.model_copy(update={field: value})
        return data

    @model_validator(mode="after")
    def _check_across_sections(self) -> AjetConfig:
        """Rules between keys of different sections, whatever the mode (ValueError naming the keys)."""
        d = self.data
        if self.trainer.val_freq and not (d.val_path or d.generator or d.env_service) and self.mode != "eval":
            raise ValueError("trainer.val_freq is set but data.val_path is not: name the held-out task file")
        if self.trainer.keep_best and not self.trainer.val_freq and self.mode != "eval":
            raise ValueError("trainer.keep_best picks the run's final model by its validation score, but "
                             "trainer.val_freq is 0: set trainer.val_freq (and data.val_path), or drop keep_best")
        if self.trainer.keep_best and self.mode == "gateway":
            raise ValueError("trainer.keep_best: the gateway chooses the policy it serves with gateway.gate (and "
                             "`ajet gateway rollback`), not by a best checkpoint: drop trainer.keep_best")
        from_dir = None if self.sft is None else Path(self.sft.from_dir).expanduser().resolve()
        if from_dir is not None and from_dir == self.exp_path().resolve():
            raise ValueError(f"sft.from_dir {from_dir} is also this run's experiment folder: give the SFT run its own "
                             f"(--exp-dir or trainer.exp_dir)")
        return self

    @model_validator(mode="after")
    def _check_mode(self) -> AjetConfig:
        """The modes that read tasks (TASK_MODES): one task source; mode serve and gateway: what their servers need
        of the config (ValueError naming the keys)."""
        from ajet.guard import configured_secret, is_loopback

        if self.mode in TASK_MODES and not self.data.task_sources():
            raise ValueError(f"data: {ONE_TASK_SOURCE} (got none)")
        server = {"serve": self.serve, "gateway": self.gateway}.get(self.mode)
        if server is not None and not is_loopback(server.host) and configured_secret(server.secret) is None:
            raise ValueError(f"{self.mode}.host {server.host!r} is reachable from other machines: set "
                             f"{self.mode}.secret (or AJET_SECRET) to a long random string first, or keep the "
                             f"default host 127.0.0.1")
        if self.mode == "serve" and self.serve.local_workers and self.workflow is None:
            raise ValueError("serve.local_workers needs a `workflow` (a class or {command: [...]}) to run")
        if self.mode != "gateway":
            return self
        g = self.gateway
        if g.n > 1 and not self.judge:
            raise ValueError(f"gateway.n is {g.n} (best-of-N) but the config names no `judge` to choose the answer: "
                             "add one (e.g. judge: ajet.judges.llm:LLMJudge) or set gateway.n: 1")
        if g.on_no_feedback == "judge" and not self.judge:
            raise ValueError("gateway.on_no_feedback is `judge` but the config names no `judge`: add one "
                             "(e.g. judge: ajet.judges.llm:LLMJudge) or set gateway.on_no_feedback: drop")
        if self.algorithm.dynamic_sampling.enabled:
            raise ValueError("algorithm.dynamic_sampling.enabled refills zero-variance same-prompt groups; the "
                             "gateway's groups are sessions by arrival: set it to false")
        if g.gate.mode == "eval" and not self.data.val_path:
            raise ValueError("gateway.gate.mode is `eval` but data.val_path is not set: name the held-out task "
                             "file the gate evaluates each new policy on, or set gateway.gate.mode: off")
        if g.gate.mode == "eval" and self.workflow is None:
            raise ValueError("gateway.gate.mode is `eval` but the config names no `workflow` to run the "
                             "held-out tasks (data.val_path) with: add one, or set gateway.gate.mode: off")
        if g.gate.mode == "replay" and not self.judge:
            raise ValueError("gateway.gate.mode is `replay` but the config names no `judge` to score the replayed "
                             "answers with: add one (e.g. judge: ajet.judges.llm:LLMJudge), or set "
                             "gateway.gate.mode: eval (held-out tasks) or off")
        return self

    def for_mode(self, mode: Mode) -> AjetConfig:
        """This config checked and resolved for command `mode` (see `mode`): a new config, this one unchanged
        (itself when it already is in `mode`). What was set keeps counting as set (`model_fields_set`).

        Raises:
            ConfigError: what `mode` refuses of the config, one line per problem naming the keys.
        """
        if mode == self.mode:
            return self
        data = self.model_dump(by_alias=True, exclude_unset=True, round_trip=True)
        try:
            return type(self).model_validate({**data, "config_dir": self.config_dir, "mode": mode})
        except ValidationError as exc:
            raise ConfigError("\n".join(describe(e) for e in exc.errors())) from None

    def exp_path(self) -> Path:
        """The experiment folder: `trainer.exp_dir` with `{experiment_name}` filled in (relative to the cwd)."""
        return Path(self.trainer.exp_dir.format(experiment_name=self.experiment_name))
