"""The Trinity-RFT backbone (`pip install 'ajet[trinity]'`): ajet explores, Trinity-RFT's trainer updates.

Importing this package imports no Trinity: `data`, `config` and `cpu` import it inside their functions,
`backbone` when the backbone is built."""

from ajet.backbones.trinity.backbone import TrinityBackbone

BACKBONE = TrinityBackbone
__all__ = ["BACKBONE", "TrinityBackbone"]
