"""The whole experiment: `AjetConfig`, the root of every section, and the checks across sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ajet.config.algorithm import AlgorithmConfig
from ajet.config.base import _Section
from ajet.config.data import DataConfig
from ajet.config.engine import EngineConfig
from ajet.config.model import AGENT_NAME, AgentConfig, ModelConfig
from ajet.config.rollout import ProxyConfig, RolloutConfig
from ajet.config.serving import GatewayConfig, ServeConfig
from ajet.config.tools import ToolsConfig
from ajet.config.trainer import EvalConfig, SftConfig, TrainerConfig
from ajet.config.workflow import (CommandWorkflowConfig, HarnessSpec, HarnessWorkflowConfig, LLMJudgeConfig,
                                  RewardModelConfig)


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
