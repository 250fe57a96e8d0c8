"""Typed experiment config: a YAML file becomes an `AjetConfig` (pydantic) with defaults.

Every section forbids unknown keys, so a typo is an error naming the key, the file and the allowed
keys (with a "did you mean"), never a silently ignored setting. Checks across keys are the models' own
validators, so a config built in Python is checked like a loaded one.

One module per concern: `model` (the policy, LoRA, agent roles), `data` (task sources), `rollout` (episodes
and the recording proxy), `algorithm` (the update), `trainer` (the loop, evaluation, SFT), `workflow` (command
and harness workflows, judges), `tools` (MCP), `serving` (`serve:` and `gateway:`), `engine` (in-process or
vLLM), `experiment` (`AjetConfig`, the root) and `loading` (YAML files to an `AjetConfig`).
"""

from ajet.config.algorithm import AlgorithmConfig, DistillConfig, DynamicSamplingConfig, GuardsConfig
from ajet.config.data import DataConfig, DatasetConfig, EnvServiceSource
from ajet.config.engine import EngineConfig
from ajet.config.experiment import AjetConfig, Mode
from ajet.config.loading import load_config, parse_overrides, resolve_path
from ajet.config.model import AGENT_NAME, AgentConfig, LoraConfig, ModelConfig
from ajet.config.rollout import ProxyConfig, RolloutConfig
from ajet.config.serving import GatewayConfig, GatewayGateConfig, ServeConfig
from ajet.config.tools import McpServerConfig, ToolAgentConfig, ToolsConfig
from ajet.config.trainer import AsyncConfig, EvalConfig, LoggerName, SftConfig, TrainerConfig
from ajet.config.workflow import (CommandWorkflowConfig, HarnessSandboxConfig, HarnessSpec, HarnessWorkflowConfig,
                                  LLMJudgeConfig, RewardModelConfig)
from ajet.errors import ConfigError

__all__ = [
    "AGENT_NAME", "AgentConfig", "AjetConfig", "AlgorithmConfig", "AsyncConfig", "CommandWorkflowConfig",
    "ConfigError", "DataConfig", "DatasetConfig", "DistillConfig", "DynamicSamplingConfig", "EngineConfig",
    "EnvServiceSource", "EvalConfig", "GatewayConfig", "GatewayGateConfig", "GuardsConfig", "HarnessSandboxConfig",
    "HarnessSpec", "HarnessWorkflowConfig", "LLMJudgeConfig", "LoggerName", "LoraConfig", "McpServerConfig",
    "Mode", "ModelConfig", "ProxyConfig", "RewardModelConfig", "RolloutConfig", "ServeConfig", "SftConfig", "ToolAgentConfig",
    "ToolsConfig", "TrainerConfig", "load_config", "parse_overrides", "resolve_path",
]
