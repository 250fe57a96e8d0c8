"""The verl backbone: verl's Ray worker groups train, verl's vLLM/SGLang servers generate, ajet drives.

    ajet YAML --verl_overrides--> verl config (verl's ppo_trainer.yaml defaults + overrides + `verl:` block)
    verl's TaskRunner helpers --> role/worker mapping and resource pools (FSDP actor, reference fused in)
    RayPPOTrainer.init_workers --> actor worker group + rollout servers (LLMServerManager; hybrid engine)
    ServerPool(RemoteEngine per server) --> the proxy's engine: token-in-token-out, sticky per episode
    update(samples) --> to_data_proto --> RayPPOTrainer._update_actor (verl's mini-batching, loss, FSDP)
    sleep_rollout / wake_rollout --> checkpoint_manager.sleep_replicas / update_weights (weight sync)

Written against verl 0.9.1 (`verl.trainer.main_ppo_v0.BaseTaskRunner`, `verl.trainer.ppo.ray_trainer`); verl
splits a step into mini-batches of `ppo_mini_batch_size * rollout.n` ROWS, so a step with forked episodes
makes more optimizer steps than `algorithm.mini_batches` says.

ajet computes the advantages (GRPO over its episodes) and the old logprobs are the engine's, so verl's own
advantage estimation and old-logprob recomputation are not used. Needs CUDA GPUs: vLLM and SGLang cannot
sample on CPU; the CPU conformance tests (tests/test_backbone_conformance.py) check the data and the loss
against verl's real functions instead.
"""

from __future__ import annotations

from pathlib import Path

from ajet.backbones.server_pool import ServerPool
from ajet.backbones.verl.config import check_keys_exist, verl_overrides
from ajet.backbones.verl.data import to_data_proto
from ajet.config import AjetConfig
from ajet.errors import BackboneUnavailable
from ajet.tracker.sample import Sample


def verl_config(cfg: AjetConfig):
    """verl's full config (an OmegaConf DictConfig) for `cfg`: verl's `ppo_trainer.yaml` composed by Hydra, with
    `verl_overrides(cfg)` applied; every overridden key must exist in verl's defaults (ConfigError otherwise)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf, open_dict

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(config_name="ppo_trainer")
    overrides = verl_overrides(cfg)
    check_keys_exist(overrides, OmegaConf.to_container(config))
    with open_dict(config):
        for key, value in overrides.items():
            OmegaConf.update(config, key, value, merge=False)
    return config


class VerlBackbone:
    """`Backbone` on verl (>= 0.9): see the module docstring.

    Raises:
        BackboneUnavailable: no CUDA GPU (verl's rollout servers need one), or verl's workers failed to start.
        ConfigError: an ajet setting verl cannot honour, or an unknown key in the `verl:` block.
    """

    def __init__(self, cfg: AjetConfig):
        import torch

        if not torch.cuda.is_available():
            raise BackboneUnavailable(
                "the verl backbone needs a CUDA GPU: verl's rollout runs on vLLM or SGLang servers, which cannot "
                "sample on CPU. On this machine use --backbone=debug (see docs/backbones.md)")
        import ray
        from verl.trainer.main_ppo_v0 import BaseTaskRunner
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
        from verl.utils import hf_tokenizer

        from ajet.model import load_tokenizer
        from ajet.remote_engine import RemoteEngine

        self.cfg = cfg
        self.config = verl_config(cfg)
        if not ray.is_initialized():
            ray.init(address=cfg.rollout.ray_address)
        runner = BaseTaskRunner()        # verl's own wiring of roles, workers and resource pools
        _, worker_group_cls = runner.add_actor_rollout_worker(self.config)
        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.chat_template)
        self.trainer = RayPPOTrainer(config=self.config, tokenizer=hf_tokenizer(cfg.model.path),
                                     role_worker_mapping=runner.role_worker_mapping,
                                     resource_pool_manager=runner.init_resource_pool_mgr(self.config),
                                     ray_worker_group_cls=worker_group_cls,
                                     # ajet samples the tasks itself; verl's trainer only needs datasets to exist
                                     train_dataset=_placeholder_tasks(cfg.trainer.tasks_per_step),
                                     val_dataset=_placeholder_tasks(1), collate_fn=_collate_nothing)
        self.trainer.init_workers()
        addresses = self.trainer.llm_server_manager.server_addresses
        self.engine = ServerPool([RemoteEngine(f"http://{a}/v1", cfg.model.path) for a in addresses])
        self.trainer.checkpoint_manager.update_weights(0)   # init_workers leaves the servers asleep

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """verl's actor update on `samples` (as a DataProto); returns verl's metrics, averaged per key."""
        from verl.utils.metric import reduce_metrics

        trainable = [s for s in samples if s.num_loss_tokens > 0]
        if not trainable:
            return {"optimizer_steps": 0.0}
        batch = to_data_proto(trainable, self.tokenizer.pad_token_id,
                              {"global_token_num": [len(s.input_ids) for s in trainable]})
        out = self.trainer._update_actor(batch)          # verl's own path from a DataProto to update_actor
        self.engine.policy_version += 1
        return {k: float(v) for k, v in reduce_metrics(out.meta_info["metrics"]).items()}

    def sleep_rollout(self) -> None:
        """The rollout servers release their weights and KV cache (verl's hybrid engine)."""
        self.trainer.checkpoint_manager.sleep_replicas()

    def wake_rollout(self) -> None:
        """Sync the actor's new weights into the rollout servers and resume them."""
        self.trainer.checkpoint_manager.update_weights(self.engine.policy_version)

    def save_checkpoint(self, path: Path) -> None:
        """verl's actor checkpoint under `path/actor` (FSDP shards + optimizer + `huggingface/` config), written
        by verl's checkpoint manager; `verl.model_merger` turns the shards into a plain HF folder."""
        self.trainer.actor_rollout_wg.save_checkpoint(str(path / "actor"), None, self.engine.policy_version, None)
        self.tokenizer.save_pretrained(path)

    def load_checkpoint(self, path: Path) -> None:
        """Restore what `save_checkpoint` wrote, then push the weights to the rollout servers."""
        self.trainer.actor_rollout_wg.load_checkpoint(str(path / "actor"), del_local_after_load=False)
        self.trainer.checkpoint_manager.update_weights(self.engine.policy_version)

    def close(self) -> None:
        import ray

        ray.shutdown()


def _placeholder_tasks(n: int) -> list[dict]:
    """A dataset of `n` empty rows: RayPPOTrainer builds dataloaders at construction; ajet never reads them."""
    return [{"index": i} for i in range(n)]


def _collate_nothing(rows: list[dict]) -> dict:
    return {"index": [r["index"] for r in rows]}
