"""The verl backbone (`pip install 'ajet[verl]'`): verl's FSDP actor trains; vLLM/SGLang servers generate on CUDA
GPUs, ajet's own engine on CPU, or ajet's vLLM engine anywhere with `engine: {kind: vllm}` (`cpu.py`: verl's CPU
platform; `weights.py`: the actor -> engine weight sync).

Importing this package imports no verl: `data`, `config` and `backbone` need only torch and ajet at import;
`backbone` imports verl when the backbone is built; `cpu` and `weights` import verl."""

from ajet.backbones.verl.backbone import VerlBackbone

BACKBONE = VerlBackbone
__all__ = ["BACKBONE", "VerlBackbone"]
