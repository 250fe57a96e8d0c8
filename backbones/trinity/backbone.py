"""The Trinity-RFT backbone: ajet explores, Trinity-RFT's own trainer updates.

    ajet's proxy + HFEngine (the debug backbone's engine) --> episodes --> context tracker --> Samples
    update(samples):
        to_experiences(samples)                        ajet's recorded token ids -> Trinity `Experience`s
        VERLTrainer.train_step(experiences)            Trinity's trainer (trinity/trainer/verl/trainer.py):
                                                       to_data_proto -> [ref logprobs] -> update_actor on its
                                                       TrinityActorRolloutRefWorker (verl 0.8 FSDP2 engine,
                                                       Trinity's policy/KL loss) in a Ray worker group
        VERLTrainer.upload_state_dict()                Trinity's MEMORY weight sync: the worker gathers the
                                                       full state dict into Trinity's Synchronizer actor
        Synchronizer.get_model_state_dict()            ajet's engine loads those tensors (no file per step)

With `engine: {kind: vllm}` a vLLM server generates instead of the HFEngine (`ajet.engines.vllm`: started by ajet
from its own venv on the model folder's weights, or `engine.urls`), and the synchronizer's tensors reach it by
`publish_weights`, the debug backbone's sync (written as safetensors, reloaded by the server); no copy of the
policy stays in this process.

Trinity's own `Trainer` class (trinity/trainer/trainer.py) wraps the same `VERLTrainer` with a loop that
pulls experiences from Trinity's buffer; ajet hands its experiences over directly instead, and drives the
weight sync the way Trinity's explorer does with `sync_method: memory`.

On a machine without CUDA the worker group runs on a local Ray cluster with logical GPU slots and the
verl changes of `backbones/trinity/cpu.py` (gloo, a CPU engine registration, pure-torch padding helpers,
fp32, sdpa attention, FSDP2), one Ray worker per FSDP rank (`trinity: {cluster: {gpu_per_node: N}}`). On CUDA
the same code trains on GPUs; generation stays ajet's engine, in-process or vLLM (Trinity's own vLLM explorer is
not used).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path

import torch

from ajet.algorithm.guards import NONFINITE_SKIPPED, nonfinite_figure, report_nonfinite
from ajet.config import AjetConfig
from ajet.ray_cluster import init_address, start_ray
from ajet.tracker.sample import Sample


class TrinityBackbone:
    """`Backbone` whose update is Trinity-RFT's `VERLTrainer.train_step` (see the module docstring).

    Args:
        cfg: the experiment config; `cfg.trinity` is merged into Trinity's config (`backbones/trinity/config.py`);
            Trinity's `cluster.gpu_per_node` there (default 1) is the number of FSDP ranks (data parallel; on CPU
            one Ray worker process each, gloo). Each step's rows are padded to a multiple of it
            (`pad_experiences`).

    Raises:
        ConfigError: an ajet setting this backbone cannot honour, or a `trinity:` key Trinity's config lacks.
        BackboneUnavailable: Ray could not start Trinity's workers.
    """

    def __init__(self, cfg: AjetConfig):
        import ray
        from trinity.manager.synchronizer import Synchronizer

        from ajet.backbones.trinity.config import trinity_config, world_size_of
        from ajet.backbones.trinity.cpu import WORKER_SETUP_HOOK, patch_verl_for_cpu, ray_init_kwargs
        from ajet.errors import BackboneUnavailable
        from ajet.model import resolve_model_path

        self.cfg = cfg
        self.on_cpu = not torch.cuda.is_available()
        self.world_size = world_size_of(cfg, self.on_cpu)   # FSDP ranks: `trinity: {cluster: {gpu_per_node: N}}`
        path = self.model_path = str(resolve_model_path(cfg.model.path))
        self.model, self.tokenizer, self.engine = _explorer_engine(cfg, path)    # model None with vLLM
        exp_dir = Path(cfg.trainer.exp_dir) if cfg.trainer.exp_dir else Path(".")
        self.config = trinity_config(cfg, path, str((exp_dir / "trinity").resolve()), self.world_size, self.on_cpu)
        if self.on_cpu:
            patch_verl_for_cpu()
        if not ray.is_initialized():
            try:
                start_ray(ray, namespace=self.config.ray_namespace,
                          **({"address": "local", **ray_init_kwargs(self.world_size)} if self.on_cpu else {
                              "address": init_address(cfg.rollout.ray_address),
                              "runtime_env": {"worker_process_setup_hook": WORKER_SETUP_HOOK}}))
            except Exception as exc:   # noqa: BLE001  (Ray raises many kinds)
                raise BackboneUnavailable(f"the trinity backbone could not start Ray: {exc}") from exc
        self._loop = asyncio.new_event_loop()           # Trinity's trainer API is async; one loop, one thread
        threading.Thread(target=self._loop.run_forever, name="trinity-trainer", daemon=True).start()
        # Trinity's Synchronizer holds the state dict the trainer uploads (sync_method: memory); it watches the
        # modules it serves and stops when none is alive: ajet's explorer is represented by a tiny actor
        self._explorer = ray.remote(_ExplorerHandle).options(namespace=self.config.ray_namespace).remote()
        self.synchronizer = ray.remote(Synchronizer).options(
            name="synchronizer", namespace=self.config.ray_namespace, get_if_exists=True,
        ).remote(self.config, module_ref=self._explorer)
        from trinity.trainer.verl.trainer import VERLTrainer

        try:
            self.trainer = VERLTrainer(self.config)
            self._run(self.trainer.prepare())
            self._real_rows = 0
            self.trainer.actor_rollout_wg.update_actor = _counting_real_rows(self.trainer.actor_rollout_wg.update_actor,
                                                                             self)
        except ray.exceptions.RayError as exc:   # e.g. a worker killed by Ray's memory monitor
            self.close()
            raise BackboneUnavailable(f"Trinity's trainer workers failed to start: {str(exc).splitlines()[0]}") \
                from exc

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ---- the RL step ------------------------------------------------------------------------------
    def update(self, samples: list[Sample]) -> dict[str, float]:
        """Trinity's `train_step` on the samples with a loss token (one Experience each), then the new weights
        into ajet's engine through Trinity's Synchronizer.

        Returns Trinity's metrics (floats; `actor/pg_loss`, `actor/grad_norm`, `actor/ppo_kl`, ...; non-finite ones
        left out) plus optimizer_steps, nonfinite_skipped (1 when a loss or gradient norm was NaN or +-inf: verl's
        engine skipped that step; a loud line says so), update_s (the train step) and sync_s (the weight sync).

        Raises:
            ValueError: the loss tokens were sampled at several temperatures or with top_p < 1 (verl scores a
                batch at one temperature, without nucleus truncation); the message names the setting.
            RuntimeError: Trinity's workers failed.
        """
        import ray

        from ajet.backbones.trinity.data import to_experiences
        from ajet.backbones.verl.data import batch_temperature

        trainable = [s for s in samples if s.num_loss_tokens > 0]
        if not trainable:
            return {"optimizer_steps": 0.0}
        t0 = time.perf_counter()
        exps = pad_experiences(to_experiences(trainable), self.world_size)
        # verl 0.8 splits the rows into mini-batches of exactly this many rows: all of them = one optimizer step
        self.trainer.config.actor.ppo_mini_batch_size = len(exps)
        self._real_rows = len(trainable)
        self.trainer.global_config.model.temperature = batch_temperature(trainable)
        try:
            metrics = self._run(self.trainer.train_step(exps))
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"Trinity's trainer step failed: {str(exc).splitlines()[0]}") from exc
        t1 = time.perf_counter()
        state, version = self._trainer_state()
        synced = self._serve(state, self.engine.policy_version + 1)
        del state
        out = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        bad = nonfinite_figure(out)   # verl's engine (under Trinity) skipped such a step itself: counted, said
        if bad is not None:
            report_nonfinite(f"Trinity's train step of policy version {self.engine.policy_version - 1}", bad)
            out = {k: v for k, v in out.items() if math.isfinite(v)}   # metrics.jsonl holds only valid JSON
        out[NONFINITE_SKIPPED] = float(bad is not None)
        out.update(optimizer_steps=float(self.trainer.config.actor.ppo_epochs), update_s=t1 - t0,
                   sync_s=time.perf_counter() - t1, trinity_step=float(version), **synced)
        return out

    def _trainer_state(self) -> tuple[dict[str, torch.Tensor], int]:
        """(the trainer's full weights under Hugging Face names, Trinity's step): Trinity's MEMORY sync, the worker
        gathering the state dict into the Synchronizer actor, read back through Ray's object store."""
        import ray

        self._run(self.trainer.upload_state_dict())
        return ray.get(self.synchronizer.get_model_state_dict.remote())

    def _serve(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Serve `state` as policy `version`: loaded into the in-process engine's model, or written and reloaded by
        the vLLM server (`publish_weights`, the debug backbone's sync). Returns the sync's figures
        (`weight_sync_s`, ...; {} in-process)."""
        from ajet.engines.vllm import publish_weights

        dtype = self.model.dtype if self.model is not None else getattr(torch, self.cfg.model.dtype)
        state = {k: v.to(dtype) for k, v in state.items()}
        with self.engine.weights_lock:
            if self.model is not None:
                self.model.load_state_dict(state)
            return publish_weights(self.engine, version, lambda: state)

    def sleep_rollout(self) -> None:
        """No-op: ajet's engine keeps its weights while Trinity's workers train their own copy."""

    def wake_rollout(self) -> None:
        """No-op: `update` already loaded the new weights into ajet's engine."""

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """The policy in Hugging Face format (ajet's engine holds the trained weights after every sync) plus
        Trinity's actor checkpoint under `path/actor` (FSDP shards, optimizer, scheduler; written by verl's
        checkpoint manager through Trinity's worker) and `backbone_state.pt` (policy version, engine RNG; with the
        vLLM engine the folder's weights are the trainer's, from the synchronizer, and there is no engine RNG: every
        call carries its own seed)."""
        path.mkdir(parents=True, exist_ok=True)
        if self.model is None:
            from ajet.engines.vllm import save_hf_folder

            save_hf_folder(self.model_path, path, self._trainer_state()[0])
        else:
            with self.engine.weights_lock:
                self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        self.trainer.actor_rollout_wg.save_checkpoint(local_path=str((path / "actor").resolve()),
                                                      global_step=self.trainer.global_steps)
        self.trainer.actor_rollout_wg.wait_on_save_thread()
        torch.save({"policy_version": self.engine.policy_version, "trinity_step": self.trainer.global_steps,
                    "engine_rng": self.engine._generator.get_state() if self.model is not None else None},
                   path / "backbone_state.pt")

    def load_checkpoint(self, path: Path) -> None:
        """Restore what `save_checkpoint` wrote: Trinity's actor (weights + optimizer) and ajet's engine (a vLLM
        server reloads the restored actor's weights before the first call)."""
        from transformers import AutoModelForCausalLM

        state = torch.load(path / "backbone_state.pt", weights_only=False)
        self.trainer.actor_rollout_wg.load_checkpoint(str((path / "actor").resolve()), del_local_after_load=False)
        self.trainer.global_steps = state["trinity_step"]
        if self.model is None:
            self._serve(self._trainer_state()[0], state["policy_version"])
            return
        saved = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
        with self.engine.weights_lock:
            self.model.load_state_dict(saved.state_dict())
            self.engine._generator.set_state(state["engine_rng"])
            self.engine.policy_version = state["policy_version"]

    def close(self) -> None:
        """Stop ajet's engine, the trainer's event loop and the Ray cluster this backbone started."""
        import ray

        self.engine.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        ray.shutdown()


def pad_experiences(exps: list, multiple: int) -> list:
    """`exps` plus copies of the first with an all-False `action_mask` (advantages and logprobs 0) up to a multiple
    of `multiple` rows: verl 0.8 splits a step evenly over the data-parallel ranks and asserts that the mini-batch
    divides by their number. A padding row adds 0 to the loss, to its gradient and to verl's loss-token count
    (`batch_num_tokens`); the `seq-mean-*` modes' row count is kept to the real rows by `_counting_real_rows`."""
    import copy

    import torch

    pad = (-len(exps)) % multiple
    blank = copy.deepcopy(exps[0])
    blank.action_mask = torch.zeros_like(blank.action_mask)
    blank.advantages = torch.zeros_like(blank.advantages)
    blank.logprobs = torch.zeros_like(blank.logprobs)
    blank.info = {**blank.info, "episode_id": "_pad"}
    return exps + [copy.deepcopy(blank) for _ in range(pad)]


def _counting_real_rows(update_actor, backbone: TrinityBackbone):
    """Trinity's `actor_rollout_wg.update_actor` (the worker group's dispatch, driver side) with the step's
    `global_batch_size` set to its rows without padding (`backbone._real_rows`). Trinity's `_update_actor` passes
    the mini-batch size (padded rows) there; its seq-mean losses average over a micro-batch's rows, padding rows
    included as 0, and `MicroBatchShareLoss` scales each micro-batch by `rows * dp_size / global_batch_size`
    (backbones/trinity/loss.py): with the real row count the step's loss is the mean over the real rows."""
    from verl.utils import tensordict_utils as tu

    def update(data, *args, **kwargs):
        if backbone._real_rows:
            tu.assign_non_tensor(data, global_batch_size=backbone._real_rows)
        return update_actor(data, *args, **kwargs)

    return update


class _ExplorerHandle:
    """ajet's explorer as Trinity's Synchronizer sees it: a module that answers `is_alive`."""

    def is_alive(self) -> bool:
        return True


def _explorer_engine(cfg: AjetConfig, path: str):
    """(model, tokenizer, engine): the policy copy ajet's proxy generates with, served by the debug backbone's
    `HFEngine` (token ids and logprobs exactly as sampled); with `engine: {kind: vllm}` (None, tokenizer,
    `VLLMEngine`) on the folder's weights, which Trinity's trainer starts from too."""
    from ajet.engines.in_process import HFEngine
    from ajet.model import load_model, load_tokenizer

    tokenizer = load_tokenizer(path, cfg.model.chat_template)
    model = load_model(path, cfg.model.dtype, cfg.model.device if cfg.engine.kind != "vllm" else "cpu").eval()
    if cfg.engine.kind == "vllm":
        from ajet.engines.vllm import vllm_engine

        return None, tokenizer, vllm_engine(cfg, path, model.state_dict())
    model.config.use_cache = True
    eos = {tokenizer.eos_token_id}
    g = model.generation_config.eos_token_id if model.generation_config is not None else None
    if g is not None:
        eos |= set(g if isinstance(g, list) else [g])
    engine = HFEngine(model, sorted(eos), tokenizer.pad_token_id, max_batch_size=cfg.rollout.max_batch_size,
                      max_model_len=cfg.model.max_model_len, decode_fn=tokenizer.decode)
    engine.seed(cfg.trainer.seed)
    return model, tokenizer, engine
