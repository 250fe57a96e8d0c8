"""ajet's RL backbones (installed as `ajet.backbones`): debug (in-process), verl, trinity."""

from ajet.backbones.base import Backbone, load_backbone

__all__ = ["Backbone", "load_backbone"]
