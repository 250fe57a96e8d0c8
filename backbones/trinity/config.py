"""ajet's YAML -> Trinity-RFT's `Config`: ONE function, one line per key, then the YAML's `trinity:` block.

ajet is the explorer (its proxy and engine generate, its context tracker builds the samples, it computes the
GRPO advantages); Trinity's trainer only updates. So the Trinity config is a `mode: train` one whose
algorithm takes the advantages as given (`compute_advantage_in_trainer` is False for Trinity's `grpo` and
`dapo` types: `dapo` when `kl_coef` is 0, as Trinity's `grpo` always builds a reference model) and the old
logprobs from the experiences (`bypass_old_logprobs`). The `trinity:` block holds any
Trinity config key, nested as in Trinity's own YAML (e.g. `algorithm: {policy_loss_fn: gspo}`); it is
merged last into Trinity's typed `Config`, which refuses a key it does not have.
"""

from __future__ import annotations

from typing import Any

from ajet.backbones.capabilities import check_supported
from ajet.config import AjetConfig
from ajet.errors import ConfigError


def trinity_dict(cfg: AjetConfig, model_path: str, checkpoint_root: str, world_size: int, on_cpu: bool) -> dict:
    """Trinity config keys (nested, as in Trinity's YAML) for `cfg`, before the `trinity:` block.

    Args:
        model_path: the policy's Hugging Face folder (Trinity's workers load it).
        checkpoint_root: Trinity's `checkpoint_root_dir` (its checkpoints go under it).
        world_size: FSDP ranks (Trinity's "GPUs" of the one node).
        on_cpu: add the CPU settings of `backbones.trinity.cpu.cpu_trainer_config`.

    Raises:
        ConfigError: an ajet setting this backbone does not honour (its declaration in
            `ajet.backbones.capabilities`), or a micro-batch setting it cannot train (the message says what to change).
    """
    m, r, a, t = cfg.model, cfg.rollout, cfg.algorithm, cfg.trainer
    check_supported(cfg, "trinity")     # the trinity declaration: model.lora, mini_batches, max_staleness, ...
    # micro-batches of micro_batch_tokens, each loss scaled to its share of the step (backbones/trinity/loss.py);
    # seq-mean-token-sum-norm divides by each micro-batch's padded width, which no share undoes: one per step
    tokens = a.micro_batch_tokens
    if a.loss_agg_mode == "seq-mean-token-sum-norm" and world_size > 1:
        raise ConfigError(f"loss_agg_mode seq-mean-token-sum-norm with {world_size} Trinity ranks (`trinity.cluster`): "
                          f"Trinity divides each rank's micro-batch by its own padded width, so the ranks would "
                          f"weigh the rows differently from one rank; train it on one rank or pick another "
                          f"loss_agg_mode")
    if a.loss_agg_mode == "seq-mean-token-sum-norm":
        if "micro_batch_tokens" in a.model_fields_set:
            raise ConfigError("algorithm.micro_batch_tokens with loss_agg_mode seq-mean-token-sum-norm: Trinity "
                              "divides each micro-batch by its own padded width, so the trinity backbone trains "
                              "this mode in one micro-batch per step; remove micro_batch_tokens or pick another "
                              "loss_agg_mode")
        tokens = m.max_model_len * t.tasks_per_step * r.num_repeat
    if tokens < m.max_model_len:
        raise ConfigError(f"algorithm.micro_batch_tokens={tokens} < model.max_model_len={m.max_model_len}: verl "
                          f"needs a whole sample in one micro-batch; raise micro_batch_tokens")
    policy_loss = {"clip_range_low": a.clip_ratio_low, "clip_range_high": a.clip_ratio_high,
                   "clip_ratio_c": a.clip_ratio_c if a.clip_ratio_c is not None else 1e9,
                   "loss_agg_mode": a.loss_agg_mode}
    return {
        "mode": "train",
        "project": "ajet",
        "name": cfg.experiment_name,
        "checkpoint_root_dir": checkpoint_root,
        "continue_from_checkpoint": False,            # ajet's --resume restores through load_checkpoint
        "model": {"model_path": model_path, "max_model_len": m.max_model_len, "max_response_tokens": r.max_tokens,
                  "temperature": r.temperature, "top_p": r.top_p},
        "cluster": {"node_num": 1, "gpu_per_node": world_size},
        "buffer": {"batch_size": t.tasks_per_step, "train_batch_size": t.tasks_per_step * r.num_repeat},
        "algorithm": {
            # both take the advantages as given (compute_advantage_in_trainer=False) and train the PPO loss; Trinity's
            # grpo type always builds a reference model, its dapo type (grpo advantages, ppo loss) builds none
            "algorithm_type": "grpo" if a.kl_coef > 0 else "dapo",
            "repeat_times": r.num_repeat,
            "bypass_old_logprobs": True,              # old logprobs = the engine's, as in ajet's debug backbone
            "optimizer": {"lr": a.lr, "weight_decay": a.weight_decay, "clip_grad": a.max_grad_norm,
                          "lr_scheduler_type": "constant", "lr_warmup_steps": 0},
            "loss_agg_mode": a.loss_agg_mode,
            "policy_loss_fn": "ppo",
            "policy_loss_fn_args": policy_loss,
            "kl_loss_fn": "low_var_kl" if a.kl_coef > 0 else "none",   # k3 clamped to [-10, 10], as ajet's
            "kl_loss_fn_args": {"kl_coef": a.kl_coef},
            "entropy_loss_fn": "none",
        },
        "trainer": {
            "trainer_strategy": "fsdp2",
            "total_steps": t.total_steps,
            "grad_clip": a.max_grad_norm,
            "use_dynamic_bsz": True,
            "max_token_len_per_gpu": tokens,
            "balance_batch": False,
            "save_interval": 0,                       # ajet saves (trainer.save_freq) through save_checkpoint
            "save_hf_checkpoint": "never",
            "trainer_config": _trainer_config(cfg, on_cpu),
        },
        "synchronizer": {"sync_method": "memory"},   # weights to the explorer through Trinity's Synchronizer
        "monitor": {"monitor_type": "tensorboard"},
    }


def _trainer_config(cfg: AjetConfig, on_cpu: bool) -> dict:
    """Trinity's `trainer.trainer_config` (verl 0.8's worker config): the CPU settings (`cpu_trainer_config`) on CPU,
    `algorithm.ppo_epochs`, and `model.gradient_checkpointing` when set (unset: on, verl's default and the CPU's)."""
    from ajet.backbones.trinity.cpu import cpu_trainer_config

    out = cpu_trainer_config() if on_cpu else {}
    out["actor"] = {**out.get("actor", {}), "ppo_epochs": cfg.algorithm.ppo_epochs}
    if cfg.model.gradient_checkpointing is not None:
        out["model"] = {**out.get("model", {}), "enable_gradient_checkpointing": cfg.model.gradient_checkpointing}
    return out


def trinity_config(cfg: AjetConfig, model_path: str, checkpoint_root: str, world_size: int = 1,
                   on_cpu: bool = True):
    """Trinity's validated `trinity.common.config.Config` for `cfg`: `trinity_dict` with the YAML's `trinity:`
    block merged on top, then Trinity's own `check_and_update` (its validators fill the derived fields).

    Raises:
        ConfigError: a `trinity:` key Trinity's config does not have (named), a value of the wrong type, or a
            setting Trinity's validators refuse (their message).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from trinity.common.config import Config

    block = cfg.trinity or {}
    if not isinstance(block, dict):
        raise ConfigError(f"`trinity:` must be a mapping of Trinity config keys, got {type(block).__name__}")
    block = _nested(block)
    base = trinity_dict(cfg, model_path, checkpoint_root, world_size, on_cpu)
    if block.get("algorithm", {}).get("policy_loss_fn", "ppo") != "ppo":   # another loss: its own defaults
        del base["algorithm"]["policy_loss_fn_args"]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), base, OmegaConf.create(block))
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"`trinity.{key}`: {str(exc).splitlines()[0]} (check the `trinity:` block against "
                          f"trinity/common/config.py)") from exc
    try:
        return config.check_and_update()
    except ValueError as exc:
        raise ConfigError(f"Trinity refused the config: {exc}") from exc


def world_size_of(cfg: AjetConfig, on_cpu: bool) -> int:
    """The number of FSDP ranks Trinity's trainer runs (data parallel): Trinity's own keys in the `trinity:` block,
    `cluster.node_num` x `cluster.gpu_per_node` (default 1 x 1). On CPU each rank is a process of the local Ray
    cluster (gloo), e.g. `trinity: {cluster: {gpu_per_node: 2}}` for 2 ranks.

    Raises:
        ConfigError: a count below 1 or not an integer, or, on CPU, several nodes or a Ray cluster to join
            (`rollout.ray_address`): the CPU trainer's Ray cluster is this machine's own, private one.
    """
    cluster = _nested(cfg.trinity or {}).get("cluster", {}) if isinstance(cfg.trinity, dict) else {}
    nodes, per_node = cluster.get("node_num", 1), cluster.get("gpu_per_node", 1)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (nodes, per_node)):
        raise ConfigError(f"`trinity.cluster`: node_num ({nodes!r}) and gpu_per_node ({per_node!r}) must be integers "
                          f">= 1 (the trinity backbone's FSDP ranks)")
    if on_cpu and nodes != 1:
        raise ConfigError(f"`trinity.cluster.node_num: {nodes}` on a machine without CUDA: the trinity backbone "
                          f"trains on this machine's local Ray cluster; set node_num: 1 and gpu_per_node: N for N "
                          f"ranks")
    address = cfg.rollout.ray_address
    if on_cpu and address not in (None, "local"):
        raise ConfigError(f"rollout.ray_address={address!r} (--ray-address) on a machine without CUDA: the trinity "
                          f"backbone trains on a private local Ray cluster of its own, which declares logical GPU "
                          f"slots for its ranks (a joined cluster has none, and Trinity would wait for them); drop "
                          f"--ray-address, or train on the cluster with --backbone verl (docs/scale-out.md)")
    return nodes * per_node


def _nested(tree: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1, "c": {"d.e": 2}} -> {"a": {"b": 1}, "c": {"d": {"e": 2}}} (dotted and nested keys both work)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        node = out
        *parents, leaf = str(key).split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _nested(value) if isinstance(value, dict) else value
    return out
