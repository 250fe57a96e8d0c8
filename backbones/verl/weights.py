"""Actor -> ajet engine weight sync, through verl's own weight export (no file round trip).

verl's actor engine exports its weights as `(hf_name, full_tensor)` pairs (`engine.get_per_tensor_param()`, what
verl's checkpoint engines send to vLLM/SGLang). `AjetActorWorker` is verl's `ActorRolloutRefWorker` with one more
Ray method, `export_weights`, that gathers that export on every FSDP rank (the all-gather is collective) and
returns the tensors from rank 0 through Ray's object store; `load_into` copies them into the model ajet's
engine serves. The worker also accepts the role "actor_ref" (actor + reference policy, no verl rollout), which
verl's role list lacks: ajet's engine is the rollout.
"""

from __future__ import annotations

import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker


class AjetActorWorker(ActorRolloutRefWorker):
    """verl's actor worker (FSDP engine, verl's `ppo_loss`, verl's checkpoint manager) for a rollout served
    outside verl.

    Args:
        config: verl's `actor_rollout_ref` config (DictConfig).
        role: "actor" (no KL term, or LoRA whose reference is the adapter disabled) or "actor_ref" (also
            builds verl's reference worker for `compute_ref_log_prob`).
    """

    def __init__(self, config, role: str, **kwargs):
        if role not in ("actor", "actor_ref"):
            raise ValueError(f"AjetActorWorker role must be 'actor' or 'actor_ref', got {role!r}")
        if not torch.cuda.is_available():
            from ajet.backbones.verl.cpu import init_process_group, replace_pinned_offload

            init_process_group()
            replace_pinned_offload()
        super().__init__(config, "actor", **kwargs)
        self.role = role          # init_model builds the reference when "ref" is in the role
        self._is_ref = role == "actor_ref"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """The actor's full weights `{hf_name: tensor}` (CPU, the training dtype) from verl's weight export;
        None on ranks other than 0 (every rank must take part in the gather)."""
        params, peft_config = self.actor.engine.get_per_tensor_param()
        if peft_config is not None:
            raise NotImplementedError("LoRA weight sync to ajet's engine: set actor_rollout_ref.model.lora.merge")
        out = {name: t.detach().to("cpu").clone() for name, t in params}
        return out if torch.distributed.get_rank() == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_adapter(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The actor's LoRA adapter as peft saves it: ({name: tensor} under peft's names, e.g.
        `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, on CPU; its peft config as a dict), from
        verl's per-tensor export with the base weights served already (`base_sync_done`: the adapter alone); None
        on ranks other than 0 (every rank must take part in the gather).

        Raises:
            ValueError: the actor has no LoRA adapter (or verl merges it: `actor_rollout_ref.model.lora.merge`).
        """
        params, peft_config = self.actor.engine.get_per_tensor_param(base_sync_done=True)
        if peft_config is None:
            raise ValueError("export_adapter: the actor has no unmerged LoRA adapter")
        out = {name: t.detach().to("cpu").clone() for name, t in params}
        return (out, peft_config) if torch.distributed.get_rank() == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def record_grads(self) -> None:
        """From now on, keep the gradients each optimizer step starts from (before verl clips them; verl zeroes
        them when its train mode exits): `export_grads` returns the last ones. For conformance checks."""
        engine = self.actor.engine
        step = engine.optimizer_step

        def recording_step(*args, **kwargs):
            grads = {}
            for name, p in engine.module.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad   # collective
                    grads[name] = g.detach().to("cpu").clone()
            self._last_grads = grads
            return step(*args, **kwargs)

        engine.optimizer_step = recording_step

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_grads(self) -> dict[str, torch.Tensor] | None:
        """`{name: full gradient}` of the last optimizer step since `record_grads` (rank 0; None elsewhere)."""
        return self._last_grads if torch.distributed.get_rank() == 0 else None


def save_adapter(folder, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
    """Write an adapter from `AjetActorWorker.export_adapter` in peft's format into `folder` (created):
    `adapter_model.safetensors` and `adapter_config.json` (what `peft.PeftModel.from_pretrained` and vLLM's
    `/v1/load_lora_adapter` read). Raises OSError when it cannot write."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(
        peft_config, indent=2, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


@torch.no_grad()
def load_into(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy verl's exported `weights` into `model` (a transformers causal LM with the same architecture).

    Raises:
        ValueError: a parameter of `model` is missing from `weights` (other than an output embedding tied to the
            input one), or `weights` holds a name `model` lacks.
    """
    own = model.state_dict()
    unknown = sorted(set(weights) - set(own))
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(own) - set(weights) - tied)
    if unknown or missing:
        raise ValueError(f"verl's exported weights do not match the engine's model: unknown {unknown[:5]}, "
                         f"missing {missing[:5]}")
    for name, tensor in weights.items():
        own[name].copy_(tensor.to(own[name].dtype))
