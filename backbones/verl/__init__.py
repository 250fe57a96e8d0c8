"""The verl backbone (`pip install 'ajet[verl]'`, CUDA GPUs): verl's FSDP actor and vLLM/SGLang servers.

Importing this package imports no verl: `data` and `config` need only torch and ajet; `backbone` imports
verl when the backbone is built."""

from ajet.backbones.verl.backbone import VerlBackbone

BACKBONE = VerlBackbone
__all__ = ["BACKBONE", "VerlBackbone"]
