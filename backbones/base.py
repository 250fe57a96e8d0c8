"""The one small protocol every backbone implements, and lazy lookup by name.

A backbone owns the policy: it serves generation (its `engine`, which the proxy calls token-in-token-out)
and runs the RL update on the samples the context tracker built. The trainer loop drives every backbone the
same way, so the proxy, the context tracker and the GRPO accounting never depend on which one runs:

    episodes = rollout(...)                 # the proxy calls backbone.engine.generate(...)
    backbone.sleep_rollout()                # rollout servers may free their memory (verl's hybrid engine)
    metrics  = backbone.update(samples)     # one RL step; policy_version += 1
    backbone.wake_rollout()                 # rollout servers serve the new weights again
    backbone.save_checkpoint(dir)           # every trainer.save_freq steps

What each backbone honours of the config is declared beside this protocol, in `capabilities.py`
(`DECLARATIONS[name]`: every config field honoured, translated to the backbone's own key, or refused);
`check_supported(cfg)` refuses a config that sets what the chosen backbone does not honour, before any
backbone package is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ajet.engines.base import Engine
from ajet.errors import BackboneUnavailable
from ajet.tracker.sample import Sample

if TYPE_CHECKING:
    from ajet.config import AjetConfig


@runtime_checkable
class Backbone(Protocol):
    """Runs the RL update and serves the current policy.

    A backbone class is constructed as `Backbone(cfg)` (`load_backbone(name)` returns the class); construction
    loads the model and starts the engine, and raises ConfigError for a setting it cannot honour (declared in
    `capabilities.py`), BackboneUnavailable when its workers cannot start, OSError when the model cannot be
    read.

    Attributes:
        engine: where generation is served: ajet's in-process `HFEngine`, ajet's `VLLMEngine` (`engine: {kind:
            vllm}`, every backbone: the trainer's weights reach it through `ajet.engines.vllm.publish_weights`
            after each update and after `load_checkpoint`), or a `ServerPool` over verl's own rollout servers;
            it serves the newest weights once `wake_rollout` returned. `engine.policy_version` is the backbone's
            policy version.
        tokenizer: the policy's tokenizer (with the chat template the proxy renders with).
    """

    engine: Engine
    tokenizer: object

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step on `samples` (advantages already set); returns scalar training metrics (floats).

        Each `Sample` is one token sequence: `prompt_ids [prompt_len]`, `response_ids`, `loss_mask`,
        `old_logprobs` `[response_len]` (tokens); the loss is the PPO clipped surrogate (Schulman et al. 2017,
        arXiv:1707.06347) over the loss-mask-1 tokens with the sample's advantage (GRPO, Shao et al. 2024,
        arXiv:2402.03300, or the configured estimator; docs/algorithm.md), in `algorithm.ppo_epochs` x
        `algorithm.mini_batches` optimizer steps. Afterwards `engine.policy_version` is one higher.

        Returns:
            At least `update_s` (seconds the update took) and `optimizer_steps`; the loss figures the backbone
            measures (e.g. `pg_loss`, `clip_frac`, `grad_norm`), each a mean over the optimizer steps.

        Raises:
            RuntimeError: the workers failed (the step's samples are not lost: they are in the trajectory store).
            BackboneOutOfMemory: (verl) Ray's memory monitor killed a worker; the message says what to lower.
        """
        ...

    def sleep_rollout(self) -> None:
        """Called after the step's rollout, before `update`: rollout servers may release their GPU memory
        (weights, KV cache). A no-op where training and generation share one copy of the weights."""
        ...

    def wake_rollout(self) -> None:
        """Called after `update`: rollout servers hold the updated weights and accept requests again."""
        ...

    def save_checkpoint(self, path: Path) -> None:
        """Write the policy in Hugging Face format (loadable with `AutoModelForCausalLM.from_pretrained`)
        plus whatever `load_checkpoint` needs to resume exactly (optimizer, RNG, policy version) into the
        folder `path` (created if missing).

        Raises:
            OSError: the folder cannot be written (e.g. the disk is full).
        """
        ...

    def load_checkpoint(self, path: Path) -> None:
        """Restore the state written by `save_checkpoint` into folder `path` (for `ajet ... --resume`).

        Raises:
            OSError: a file of the checkpoint is missing or unreadable.
            ConfigError: the checkpoint does not fit this config (e.g. other LoRA adapters or agent roles).
        """
        ...

    def close(self) -> None:
        """Release the engine and workers."""
        ...


def policy_version(backbone: Backbone) -> int:
    """The optimizer steps applied to the weights the engine serves (0 = initial weights)."""
    return backbone.engine.policy_version


def missing_members(backbone: object) -> list[str]:
    """The names of the `Backbone` protocol that `backbone` lacks (empty when it conforms)."""
    names = ["engine", "tokenizer", "update", "sleep_rollout", "wake_rollout", "save_checkpoint",
             "load_checkpoint", "close"]
    return [n for n in names if not hasattr(backbone, n)]


# name -> (module with the adapter, the package it needs, the pip extra that installs it); what each honours of
# the config: capabilities.DECLARATIONS[name]
_BACKBONES = {
    "debug": ("ajet.backbones.debug", None, None),
    "verl": ("ajet.backbones.verl", "verl", "verl"),
    "trinity": ("ajet.backbones.trinity", "trinity", "trinity"),
}


def load_backbone(name: str, cfg: AjetConfig | None = None) -> type:
    """The backbone class for `name`, importing its heavy dependencies only now.

    Args:
        cfg: when given, first refuse what backbone `name` does not honour of it (`capabilities.check_supported`),
            before any of the backbone's packages is imported.

    Raises:
        BackboneUnavailable: unknown name, or the backbone's package is not installed (names the extra).
        ConfigError: `cfg` sets what backbone `name` does not honour (naming the key and the backbones that do).
    """
    if name not in _BACKBONES:
        raise BackboneUnavailable(f"unknown backbone {name!r}: choose one of {', '.join(_BACKBONES)}")
    if cfg is not None:
        from ajet.backbones.capabilities import check_supported   # here: `python -m` runs that module unimported

        check_supported(cfg, name)
    module, needs, extra = _BACKBONES[name]
    if needs is not None and importlib.util.find_spec(needs) is None:
        raise BackboneUnavailable(
            f"the {name} backbone needs the `{needs}` package, which is not installed: pip install 'ajet[{extra}]' "
            f"in its own environment (`ajet backbone-env {name}` builds .venvs/{name}; it trains on CPU or "
            f"CUDA GPUs, see docs/backbones.md), or run with --backbone=debug")
    try:
        return importlib.import_module(module).BACKBONE
    except ModuleNotFoundError as exc:
        raise BackboneUnavailable(f"the {name} backbone adapter is not available in this ajet version ({exc})") from exc
