"""The Trinity-RFT backbone (`pip install 'ajet[trinity]'`): ajet explores, Trinity-RFT's trainer updates.

Importing this package imports no Trinity, and no torch: `TrinityBackbone` (`BACKBONE`) is imported on first use,
and `data`, `config` and `cpu` import Trinity inside their functions. So a Ray worker of the backbone's cluster
that runs only its setup hook (`loss.setup_worker`) pays for nothing else."""

from __future__ import annotations

__all__ = ["BACKBONE", "TrinityBackbone"]


def __getattr__(name: str):
    if name in ("BACKBONE", "TrinityBackbone"):
        from ajet.backbones.trinity.backbone import TrinityBackbone

        return TrinityBackbone
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
