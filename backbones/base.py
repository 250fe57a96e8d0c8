"""The one small protocol every backbone implements, and lazy lookup by name."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

from ajet.engine import Engine
from ajet.errors import BackboneUnavailable
from ajet.tracker.sample import Sample


class Backbone(Protocol):
    """Runs the RL update and serves the current policy.

    Attributes:
        engine: the inference engine the proxy sends prompts to; serves the newest weights after `update`.
        tokenizer: the policy's tokenizer (with the chat template the proxy renders with).
    """

    engine: Engine
    tokenizer: object

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step on `samples` (advantages already set); returns scalar training metrics."""
        ...

    def save_checkpoint(self, path: Path) -> None:
        """Write the policy in Hugging Face format (loadable with `AutoModelForCausalLM.from_pretrained`)
        plus whatever `load_checkpoint` needs to resume exactly (optimizer, RNG, policy version)."""
        ...

    def load_checkpoint(self, path: Path) -> None:
        """Restore the state written by `save_checkpoint` (for `ajet ... --resume`)."""
        ...

    def close(self) -> None:
        """Release the engine and workers."""
        ...


# name -> (module with the adapter, the package it needs, the pip extra that installs it)
_BACKBONES = {
    "debug": ("ajet.backbones.debug", None, None),
    "verl": ("ajet.backbones.verl", "verl", "verl"),
    "trinity": ("ajet.backbones.trinity", "trinity", "trinity"),
}


def load_backbone(name: str) -> type:
    """The backbone class for `name`, importing its heavy dependencies only now.

    Raises:
        BackboneUnavailable: unknown name, or the backbone's package is not installed (names the extra).
    """
    if name not in _BACKBONES:
        raise BackboneUnavailable(f"unknown backbone {name!r}: choose one of {', '.join(_BACKBONES)}")
    module, needs, extra = _BACKBONES[name]
    if needs is not None and importlib.util.find_spec(needs) is None:
        raise BackboneUnavailable(
            f"the {name} backbone needs the `{needs}` package (CUDA machines only): pip install 'ajet[{extra}]', "
            f"or run with --backbone=debug")
    try:
        return importlib.import_module(module).BACKBONE
    except ModuleNotFoundError as exc:
        raise BackboneUnavailable(f"the {name} backbone adapter is not available in this ajet version ({exc})") from exc
