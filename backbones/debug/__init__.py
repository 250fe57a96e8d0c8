"""The debug backbone: one process, no Ray; a real GRPO update on CPU or one GPU."""

from ajet.backbones.debug.backbone import DebugBackbone

BACKBONE = DebugBackbone
__all__ = ["BACKBONE", "DebugBackbone"]
