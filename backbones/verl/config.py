"""ajet's YAML -> verl's config: ONE function, one line per key, nothing hidden.

`verl_overrides(cfg)` returns verl config keys (dotted, as on verl's command line) for an `AjetConfig`;
the verl backbone applies them onto verl's own defaults (`verl/trainer/config/ppo_trainer.yaml`) and then
the YAML's `verl:` block, which passes any verl option through unchanged. Every ajet key is either
translated below, used by ajet itself (proxy, rollout, context tracker, GRPO advantages: ajet computes the
advantages and verl's actor trains on them), or refused with an error that names it.
"""

from __future__ import annotations

from typing import Any

from ajet.config import AjetConfig
from ajet.errors import ConfigError

# ajet keys that ajet itself honours, whichever backbone runs (no verl counterpart needed)
AJET_SIDE = (
    "experiment_name", "workflow", "judge", "data.*", "proxy.*", "trainer.total_steps", "trainer.tasks_per_step",
    "trainer.save_freq", "trainer.exp_dir", "trainer.tensorboard", "trainer.save_trajectories", "trainer.resume",
    "trainer.max_failed_steps", "model.chat_template", "rollout.num_repeat", "rollout.sampling_policy",
    "rollout.max_concurrency", "rollout.episode_timeout_s", "rollout.failed_episode_policy",
    "rollout.ray_workers", "rollout.ray_address", "algorithm.name", "algorithm.adv_eps",
    "algorithm.group_by_agent_tag", "algorithm.trainable_targets", "algorithm.train_greedy_calls",
    "trainer.loggers", "trainer.val_freq", "trainer.async_", "serve.*", "tools.*", "eval.*", "llm_judge.*",
)


# ajet keys translated by `verl_overrides` (the source of each line of its table)
TRANSLATED = (
    "backbone", "verl", "model.path", "model.dtype", "model.device", "model.max_model_len", "model.lora",
    "rollout.temperature", "rollout.top_p", "rollout.max_tokens", "rollout.max_batch_size",
    "algorithm.lr", "algorithm.weight_decay", "algorithm.clip_ratio_low", "algorithm.clip_ratio_high",
    "algorithm.clip_ratio_c", "algorithm.loss_agg_mode", "algorithm.loss_scale_factor", "algorithm.ppo_epochs",
    "algorithm.mini_batches", "algorithm.micro_batch_tokens", "algorithm.max_grad_norm", "algorithm.kl_coef",
    "algorithm.norm_adv_by_std", "trainer.seed",
)


def unsupported_keys(cfg: AjetConfig) -> list[str]:
    """The keys the YAML sets that neither ajet itself nor this translation honours (e.g. a key added to
    `AjetConfig` after this table was written): `verl_overrides` refuses them rather than ignore them."""
    def known(key: str) -> bool:
        return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in TRANSLATED + AJET_SIDE)

    out = []
    for name in cfg.model_fields_set - {"config_dir"}:     # config_dir: where the YAML was, not a setting
        value = getattr(cfg, name)
        children = value.model_fields_set if hasattr(value, "model_fields_set") and name != "verl" else ()
        keys = [f"{name}.{c}" for c in children] if children and not known(name) else [name]
        out += [k for k in keys if not known(k)]
    return sorted(out)


def verl_overrides(cfg: AjetConfig) -> dict[str, Any]:
    """verl config keys (dotted) for `cfg`, then the YAML's `verl:` block on top.

    Raises:
        ConfigError: an ajet setting verl cannot honour (the message names the key and what to do), or a
            `verl:` block that is not a mapping.
    """
    m, r, a, t = cfg.model, cfg.rollout, cfg.algorithm, cfg.trainer
    if unsupported := unsupported_keys(cfg):
        raise ConfigError(f"the verl backbone does not support {', '.join(f'`{k}`' for k in unsupported)}: remove "
                          f"it, or set the verl option you mean in the `verl:` block")
    if m.device not in ("auto", "cuda"):
        raise ConfigError(f"model.device={m.device!r}: the verl backbone trains and samples on CUDA GPUs only; "
                          f"remove model.device (or use --backbone=debug)")
    if m.path == "smollm2-135m-instruct":
        raise ConfigError("model.path='smollm2-135m-instruct' is ajet's embedded GGUF model, which vLLM/SGLang cannot "
                          "serve: give a Hugging Face id or folder (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
    if a.mini_batches > t.tasks_per_step or t.tasks_per_step % a.mini_batches:
        raise ConfigError(f"algorithm.mini_batches={a.mini_batches}: verl splits a step by task groups, so it must "
                          f"divide trainer.tasks_per_step={t.tasks_per_step}")
    if t.async_.max_staleness:
        raise ConfigError(f"trainer.async.max_staleness={t.async_.max_staleness}: the verl backbone does not apply "
                          f"ajet's importance-sampling correction of off-policy samples yet; use 0 (or leave it unset), "
                          f"or --backbone=debug")
    if a.loss_agg_mode == "seq-mean-token-sum-norm" and a.loss_scale_factor is None:
        raise ConfigError("algorithm.loss_agg_mode=seq-mean-token-sum-norm needs algorithm.loss_scale_factor on the "
                          "verl backbone (verl's default, the padded response width, changes from step to step here)")
    out: dict[str, Any] = {
        # the policy
        "actor_rollout_ref.model.path": m.path,
        "actor_rollout_ref.rollout.dtype": _VLLM_DTYPE[m.dtype],
        "actor_rollout_ref.actor.fsdp_config.dtype": m.dtype,
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
        "actor_rollout_ref.actor.ppo_mini_batch_size": t.tasks_per_step // a.mini_batches,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,            # micro-batches by tokens, as ajet packs them
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": a.micro_batch_tokens,
        "actor_rollout_ref.actor.grad_clip": a.max_grad_norm,
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
    if a.loss_scale_factor is not None:
        out["actor_rollout_ref.actor.loss_scale_factor"] = a.loss_scale_factor
    if m.lora:
        out["actor_rollout_ref.model.lora_alpha"] = m.lora.alpha
        out["actor_rollout_ref.model.target_modules"] = m.lora.target_modules
    if cfg.verl is not None:
        if not isinstance(cfg.verl, dict):
            raise ConfigError(f"`verl:` must be a mapping of verl config keys, got {type(cfg.verl).__name__}")
        out.update(flatten(cfg.verl))
    return out


_VLLM_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


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


def check_keys_exist(overrides: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Refuse any dotted key of `overrides` that verl's default config (`defaults`, nested) does not have.

    Raises:
        ConfigError: naming every unknown key (a typo in the `verl:` block, or a key this verl version dropped).
    """
    unknown = []
    for key in overrides:
        node: Any = defaults
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                unknown.append(key)
                break
            node = node[part]
    if unknown:
        raise ConfigError("verl's config has no key " + ", ".join(f"`{k}`" for k in unknown)
                          + " (check the `verl:` block against verl/trainer/config/ppo_trainer.yaml)")
