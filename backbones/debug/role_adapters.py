"""One peft LoRA adapter per agent role on one frozen base model (`agents:` in the config): building them, their
parameters (one optimizer each), and their checkpoint folders.

peft's multi-adapter API: `get_peft_model` creates the first adapter, `PeftModel.add_adapter` the others,
`PeftModel.set_adapter` chooses the one a training forward uses (and makes only its weights require grad), and a
forward given `adapter_names` (one per batch row) serves a batch that mixes adapters (peft's mixed-adapter
batch inference; eval mode only). The routing from agent tags to adapters is `ajet.agent_adapters`.

Checkpoint layout (`save_adapters`): `<ckpt>/adapters/<name>/` holds `adapter_config.json` and
`adapter_model.safetensors`, peft's own format: `peft.PeftModel.from_pretrained(base, folder)` loads it, and vLLM
serves it with `--enable-lora --lora-modules <name>=<folder>`.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from ajet.agent_adapters import adapter_lora, adapter_names
from ajet.config import AjetConfig, LoraConfig
from ajet.errors import ConfigError

ADAPTERS_DIR = "adapters"


def _peft_lora(lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                          lora_dropout=lora.dropout, task_type="CAUSAL_LM")


def with_role_adapters(model, cfg: AjetConfig, model_dir: str):
    """`model` wrapped by peft with one trainable LoRA adapter per name of `adapter_names(cfg)` (base weights
    frozen). When `model_dir` (the resolved `model.path`) is a checkpoint folder holding `adapters/<name>/` (e.g.
    `ajet eval --checkpoint`), each adapter found there is loaded.

    Raises:
        ConfigError: a saved adapter does not fit its role's settings (another rank or target modules).
    """
    from peft import get_peft_model

    names = adapter_names(cfg)
    peft_model = get_peft_model(model, _peft_lora(adapter_lora(cfg, names[0])), adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, _peft_lora(adapter_lora(cfg, name)))
    for name in names:                    # add_adapter leaves a new adapter frozen until set_adapter
        for p in adapter_parameters(peft_model, name):
            p.requires_grad_(True)
    saved = Path(model_dir) / ADAPTERS_DIR
    if saved.is_dir():
        load_adapters(peft_model, saved, [n for n in names if (saved / n).is_dir()])
    return peft_model


def adapter_parameters(peft_model, name: str) -> list[torch.nn.Parameter]:
    """The LoRA weights of adapter `name` (peft names them `...lora_A.<name>.weight`, `...lora_B.<name>.weight`)."""
    out = []
    for key, p in peft_model.named_parameters():
        parts = key.split(".")
        if any(part.startswith("lora_") and parts[i + 1] == name for i, part in enumerate(parts[:-1])):
            out.append(p)
    return out


def save_adapters(peft_model, folder: Path, names: list[str]) -> None:
    """Write each adapter of `names` to `folder/<name>/` in peft's format (see the module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            peft_model.save_pretrained(tmp, selected_adapters=[name])
            written = Path(tmp) if name == "default" else Path(tmp) / name   # peft's own layout
            target = folder / name
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for f in written.iterdir():
                if f.is_file():
                    shutil.move(str(f), str(target / f.name))


def load_adapters(peft_model, folder: Path, names: list[str]) -> None:
    """Load each adapter of `names` from `folder/<name>/adapter_model.safetensors` into the live model.

    Raises:
        ConfigError: a saved adapter's shapes differ from the live one's (its role's settings changed).
        FileNotFoundError: a folder lacks its weights.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    for name in names:
        weights = folder / name / "adapter_model.safetensors"
        try:
            result = set_peft_model_state_dict(peft_model, load_file(str(weights)), adapter_name=name)
        except RuntimeError as exc:      # size mismatch
            raise ConfigError(f"agents.{name}: the adapter saved in {folder / name} does not fit the configured "
                              f"one (rank or target_modules changed?): {str(exc).splitlines()[0]}") from exc
        missing = [k for k in result.missing_keys if f".{name}." in k and "lora_" in k]
        if missing:
            raise ConfigError(f"agents.{name}: the adapter saved in {folder / name} lacks {len(missing)} of the "
                              f"configured adapter's weights (target_modules changed?), e.g. {missing[0]}")


@torch.no_grad()
def base_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """The frozen base model's state dict with its own keys (no LoRA weights, `.base_layer` dropped), so that
    `AutoModelForCausalLM.from_pretrained` loads the saved folder as the base model."""
    out = {}
    for key, value in peft_model.get_base_model().state_dict().items():
        if ".lora_" not in key:
            out[key.replace(".base_layer", "")] = value
    return out
