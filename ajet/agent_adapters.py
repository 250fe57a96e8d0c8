"""Which LoRA adapter serves and trains each agent role (`agents:` in the config).

With `agents: {planner: {lora: {r: 16}}, solver: {lora: {r: 8}}}` the policy is one frozen base model plus one
peft LoRA adapter per listed role (Hu et al. 2021, "LoRA"), named as the role. Every other agent tag (and the tag
`default` of calls made without `tuner.agent(...)`) is served and trained by the shared adapter `default`, whose
settings are `model.lora` (LoRA's defaults when unset); LoRA's B matrices start at zero, so every adapter starts
as the base model. Backbones and engines use these helpers so that they route the same way: the debug engine
passes the adapter of each row to peft (`adapter_names`), `RemoteEngine` sends it as the request's `model` (vLLM
`--enable-lora --lora-modules <name>=<folder>`), and the update trains each adapter on its role's samples.
"""

from __future__ import annotations

import statistics
from typing import Callable

from ajet.config import AjetConfig, LoraConfig

DEFAULT_ADAPTER = "default"
"""The adapter of every agent tag not listed in `agents:`."""


def adapter_names(cfg: AjetConfig) -> list[str]:
    """The adapters of a run with `agents:`: `default` first, then the listed roles in config order; [] without
    `agents:` (one policy)."""
    if not cfg.agents:
        return []
    return [DEFAULT_ADAPTER] + [name for name in cfg.agents if name != DEFAULT_ADAPTER]


def adapter_router(cfg: AjetConfig) -> Callable[[str | None], str] | None:
    """agent tag -> the adapter that serves and trains it (the tag itself when listed in `agents:`, else
    `default`; a call without a tag, None, is `default`); None without `agents:`."""
    if not cfg.agents:
        return None
    listed = frozenset(cfg.agents)

    def adapter_for(tag: str | None) -> str:
        return tag if tag in listed else DEFAULT_ADAPTER

    return adapter_for


def adapter_lora(cfg: AjetConfig, name: str) -> LoraConfig:
    """The LoRA settings of adapter `name`: `agents.<name>.lora`, or for `default` `model.lora` (LoRA's defaults
    when unset)."""
    if name in cfg.agents:
        return cfg.agents[name].lora
    return cfg.model.lora or LoraConfig()


def role_metrics(episodes: list, trained: list) -> dict[str, float]:
    """Per agent role (tag) of one step: `reward/<role>` (mean reward of the successful episodes in which the role
    made a call), `rollout/<role>/calls`, `tracker/<role>/trained_samples` (samples of `trained`, the update's).

    Args:
        episodes: the step's `Episode`s; trained: the `Sample`s the update trains.
    """
    rewards: dict[str, list[float]] = {}
    calls: dict[str, int] = {}
    for e in episodes:
        tags = [c.agent_tag for c in e.calls]
        for tag in tags:
            calls[tag] = calls.get(tag, 0) + 1
        if e.ok and e.reward is not None:
            for tag in dict.fromkeys(tags):
                rewards.setdefault(tag, []).append(float(e.reward))
    out: dict[str, float] = {f"reward/{tag}": statistics.fmean(r) for tag, r in sorted(rewards.items())
                             if tag not in ("mean", "std", "max")}   # the step's own reward/* figures
    out.update({f"rollout/{tag}/calls": float(n) for tag, n in sorted(calls.items())})
    for tag in sorted(calls):
        out[f"tracker/{tag}/trained_samples"] = float(sum(1 for s in trained if s.agent_tag == tag))
    return out
