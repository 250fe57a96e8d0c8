"""The debug backbone: the policy, its engine and a GRPO update, all in this process.

One model object both generates (`HFEngine`) and trains, so the next step's rollouts use the updated
weights without a copy. Breakpoints work anywhere (no Ray, no subprocesses).

With `model.lora` the policy is the base model plus LoRA adapters (Hu et al. 2021, via `peft`): only the
adapters train, the engine serves the adapted model, and the reference policy of the KL term is the same
model with the adapter disabled (no second copy of the weights).

With `agents:` the policy is one adapter per agent role (`backbones/debug/role_adapters.py`): the engine serves
each call with its role's adapter (a batch mixes adapters), and one update trains each adapter that has samples
on its own role's samples, with its own optimizer; the other adapters' weights are not touched.
"""

from __future__ import annotations

import copy
import logging
import random
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from ajet import progress
from ajet.agent_adapters import adapter_names, adapter_router
from ajet.algorithm.batching import split_mini_batches
from ajet.algorithm.guards import NONFINITE_SKIPPED, nonfinite_figure, report_nonfinite
from ajet.algorithm.loss import distill_loss, loss_token_weights, ppo_clip_loss, sft_loss, truncated_is_weights
from ajet.engines.in_process import HFEngine, engine_for
from ajet.backbones.debug.role_adapters import (ADAPTERS_DIR, adapter_parameters, base_state_dict, load_adapters,
                                                save_adapters, with_role_adapters)
from ajet.backbones.debug.serving import ServeWhileTraining
from ajet.backbones.debug.shared_prefix import pack, pack_rows, supports_packing
from ajet.config import AjetConfig
from ajet.errors import ConfigError
from ajet.heap import trim_free_memory
from ajet.model import load_model, load_tokenizer, resolve_model_path
from ajet.backbones.debug.remote_teacher import RemoteTeacher
from ajet.sampling_dist import entropy, processed_logprobs
from ajet.tracker.sample import Sample


class DebugBackbone(ServeWhileTraining):
    """Single-process backbone. See `ajet.backbones.base.Backbone` for the protocol.

    Args:
        cfg: the experiment config (model, rollout, algorithm sections are read).

    Attributes:
        share_prefixes: the update's forwards pack samples that share a prefix (a GRPO group's prompt) into
            rows that run it once (`backbones/debug/shared_prefix.py`): the same loss and gradients up to float
            rounding in less time. On where the model `supports_packing`; set False for one row per sample
            (`benchmarks/update_shared_prefix.py` times both).
    """

    def __init__(self, cfg: AjetConfig):
        self.cfg = cfg
        path = resolve_model_path(cfg.model.path)
        self.tokenizer = load_tokenizer(path, cfg.model.chat_template)
        self.model = load_model(path, cfg.model.dtype, cfg.model.device)
        # with `agents:` one adapter per role (the routing: ajet/agent_adapters.py), else at most one adapter
        self.adapters = adapter_names(cfg)
        self.adapter_for = adapter_router(cfg)
        if self.adapters:
            self.model = with_role_adapters(self.model, cfg, path)
        elif cfg.model.lora is not None:
            self.model = _with_lora(self.model, cfg.model.lora)
        self.model.config.use_cache = True
        if cfg.model.gradient_checkpointing:   # the update recomputes each layer: same gradients, less memory
            enable_activation_checkpointing(self.model)
        self.device = next(self.model.parameters()).device
        if cfg.engine.kind == "vllm":   # a vLLM server generates; the weights reach it after each update
            from ajet.engines.vllm import vllm_engine

            self.engine = vllm_engine(cfg, path, self._served_state_dict(),
                                      self._write_adapters if self._lora_served() else None)
        else:
            self.engine = engine_for(self.model, self.tokenizer, cfg, self.adapter_for)
        self.share_prefixes = supports_packing(self.model)
        alg = cfg.algorithm
        groups = ({name: adapter_parameters(self.model, name) for name in self.adapters} if self.adapters else
                  {None: [p for p in self.model.parameters() if p.requires_grad]})
        # one optimizer per adapter (`self.optimizer` is the one of the policy being trained)
        self.optimizers = {name: torch.optim.AdamW(params, lr=alg.lr, weight_decay=alg.weight_decay)
                           for name, params in groups.items()}
        self.optimizer = next(iter(self.optimizers.values()))
        self.lora = cfg.model.lora is not None or bool(self.adapters)
        self.ref_model = None
        if alg.kl_coef > 0 and not self.lora:   # with LoRA the reference is the model with its adapter off
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.teacher = _load_teacher(cfg, self.model) if alg.distill is not None else None
        self._rng = random.Random(cfg.trainer.seed)
        # asynchronous training: the loss corrects off-policy tokens by truncated importance sampling
        self.is_cap = cfg.trainer.async_.is_cap if cfg.trainer.async_.max_staleness else None
        self._prox: dict[int, list[float]] | None = None   # id(sample) -> log pi_prox of its response tokens
        self._teacher_lp: dict[int, list[float]] | None = None   # id(sample) -> a URL teacher's logprobs
        # serving while training (`serve_while_training`): the engine serves `served_model`, the update trains
        # `self.model`, and a trained policy waits as `candidate_version` until `publish`
        self.serves_while_training = False
        self.served_model = self.model
        self.candidate_version: int | None = None
        self._trainer_engine: HFEngine | None = None

    # ---- the RL step ------------------------------------------------------------------------------
    def update(self, samples: list[Sample]) -> dict[str, float]:
        """PPO-clip epochs over `samples`, split into `mini_batches` optimizer steps by episode.

        Every sample must carry its episode's advantage; every sample with a loss token is trained (a
        sample whose advantage is 0 adds exactly 0 without a KL term and is not forwarded).
        With `trainer.async.max_staleness` > 0 (`is_cap` set), the PPO ratio is taken against the policy the
        update starts from (pi_prox: this forward when the step is one optimizer step, else a no-grad pass
        first) and each token's loss is weighted by `truncated_is_weights` (pi_prox / pi_behaviour, capped).

        A step whose loss or gradient norm is NaN or +-inf is skipped (weights and optimizer state unchanged, a
        loud line on stderr: `ajet.algorithm.guards.report_nonfinite`) and counted in nonfinite_skipped.

        Returns: loss, pg_loss, kl, grad_norm (means over optimizer steps; a skipped step counts 0);
        nonfinite_skipped (steps skipped); clip_frac, dual_clip_frac,
        ratio_mean (means over every trained token of every optimizer step under the weights the loss gives
        them: the aggregation weight, times the IS weight with is_cap); with is_cap is_weight_mean and
        is_capped_frac (the mean IS weight and the share of tokens at the cap, under the aggregation weights
        alone, e.g. the token mean in token-mean mode); entropy (nats)
        and logprob_diff (mean |trainer - engine| logprob), token means over the forwarded loss tokens
        measured BEFORE any weight moves in this step (0 up to numerics when rollout and training
        agree); optimizer_steps, update_s.
        With `agents:` each adapter with samples is trained on its roles' samples with its own optimizer
        (`_update_roles`): its figures come as `train/<adapter>/<figure>`, the plain ones are their means over the
        adapters trained (optimizer_steps their sum); the engine's policy version moves once per update.
        With an `sft:` section the update is supervised instead: see `sft_update`.
        """
        if self.cfg.sft is not None:   # fine-tuning on recorded traces (ajet/commands/sft.py)
            return self.sft_update(samples)
        t0 = time.perf_counter()
        trainable = [s for s in samples if s.num_loss_tokens > 0]
        if not trainable:
            return {"update_s": 0.0, "optimizer_steps": 0.0}
        # a URL teacher's logprobs do not depend on the student's weights: fetched once, before the engine is paused,
        # not per mini-batch and epoch
        self._teacher_lp = (_remote_teacher_logprobs(self.teacher, [s for s in trainable if self._forwarded(s)])
                            if isinstance(self.teacher, RemoteTeacher) else None)
        try:
            with self._weights_held():   # every adapter moves between the same two decode steps
                # every stored prefix was computed by the weights this update replaces, so none is reused after it
                # (the cache skips other versions' entries): free their memory (up to its budget) before training;
                # serving while training too, so that the update's memory does not come on top of it (the served
                # engine's worker clears them before its next step and stores new ones meanwhile)
                if isinstance(self.engine, HFEngine) and self.serves_while_training:
                    self.engine.drop_prefixes()
                elif isinstance(self.engine, HFEngine):
                    self.engine.prefix_cache.clear()
                # and hand back what the engine's thread freed (its malloc arena keeps it otherwise: ajet/heap.py),
                # so that the update's activations do not come on top of it
                trim_free_memory()
                out = self._update_roles(trainable) if self.adapters else self._ppo_update(trainable)
                out.update(self._trained(self.engine.policy_version + 1))
        finally:
            self._prox = self._teacher_lp = None
            trim_free_memory()     # the activations' memory, freed in this thread: back before the next sampling
        out["update_s"] = time.perf_counter() - t0
        return out

    def _update_roles(self, trainable: list[Sample]) -> dict[str, float]:
        """`_ppo_update` of each adapter on the samples of its roles (`adapter_for(sample.agent_tag)`), with the
        adapter's own optimizer; an adapter without samples is not touched (its weights and optimizer state stay
        bit-identical). Returns each adapter's figures as `train/<adapter>/<figure>`, and the unprefixed figures
        as the mean over the adapters trained (optimizer_steps: their sum). Runs under `weights_lock`."""
        by_adapter: dict[str, list[Sample]] = defaultdict(list)
        for s in trainable:
            by_adapter[self.adapter_for(s.agent_tag)].append(s)
        out: dict[str, float] = {}
        per: list[dict[str, float]] = []
        for name in [n for n in self.adapters if n in by_adapter]:
            with self._training(name):
                stats = self._ppo_update(by_adapter[name])
            out.update({f"train/{name}/{k}": v for k, v in stats.items()})
            per.append(stats)
        out.update({k: statistics.fmean(p[k] for p in per) for k in per[0]})
        out["optimizer_steps"] = float(sum(p["optimizer_steps"] for p in per))
        out[NONFINITE_SKIPPED] = float(sum(p[NONFINITE_SKIPPED] for p in per))
        return out

    @contextmanager
    def _training(self, name: str):
        """Within: the training forwards use adapter `name` (peft's `set_adapter`, which also leaves only its
        weights requiring grad) and `self.optimizer` is its optimizer."""
        self.model.set_adapter(name)
        self.optimizer = self.optimizers[name]
        try:
            yield
        finally:
            self.optimizer = self.optimizers[self.adapters[0]]

    def _ppo_update(self, trainable: list[Sample]) -> dict[str, float]:
        """The PPO-clip epochs of `update` over `trainable` (samples with loss tokens) with `self.optimizer`,
        under `weights_lock`; returns `update`'s figures but update_s."""
        alg = self.cfg.algorithm
        episodes = sorted({s.episode_id for s in trainable})
        one_step = alg.ppo_epochs == 1 and split_mini_batches(episodes, alg.mini_batches) == [episodes]
        totals: dict[str, float] = {}
        steps = 0
        # with one optimizer step the first forward sees the rollout weights; else measure them first
        before = None if one_step else self.measure(trainable)
        self._prox = self._proximal_logprobs(trainable) if self.is_cap is not None and not one_step else None
        self.model.train()
        # the progress display (ajet/progress.py): mini-batches done / total; closed also when a step raises
        with progress.phase("update", alg.ppo_epochs * len(split_mini_batches(episodes, alg.mini_batches))) as bar:
            for epoch in range(alg.ppo_epochs):
                self._rng.shuffle(episodes)
                for mb_eps in split_mini_batches(episodes, alg.mini_batches):
                    bar.advance(0, epoch=epoch + 1)
                    chosen = set(mb_eps)
                    stats = self._optimizer_step([s for s in trainable if s.episode_id in chosen])
                    for k, v in stats.items():
                        totals[k] = totals.get(k, 0.0) + v
                    steps += 1
                    bar.advance(1)
        self.model.eval()
        # the PPO figures are means under the loss's own token weights (times the IS weight when is_cap is set);
        # the IS figures are means of the IS weight itself, under the aggregation weights alone
        means = {"weight_sum": ("clip_frac", "dual_clip_frac", "ratio_mean"),
                 "_is_weight_sum": ("is_weight_mean", "is_capped_frac") if self.is_cap is not None else ()}
        out = {}
        for denominator, keys in means.items():
            mass = totals.pop(denominator, 0.0)
            out.update({k: totals.pop(k) / mass if mass > 0 else 0.0 for k in keys})
        before = before or {k: totals.pop(f"_{k}") / totals["_tokens"] if totals["_tokens"] else 0.0
                            for k in ("entropy", "logprob_diff")}
        skipped = totals.pop(NONFINITE_SKIPPED, 0.0)   # a count, not a mean
        out.update({k: v / steps for k, v in totals.items() if not k.startswith("_")}, **before)
        out[NONFINITE_SKIPPED] = skipped
        out["optimizer_steps"] = float(steps)
        return out

    def sft_update(self, samples: list[Sample]) -> dict[str, float]:
        """Supervised fine-tuning on `samples` (their recorded tokens and loss masks; advantages are not used):
        `algorithm.ppo_epochs` passes, each split into `algorithm.mini_batches` optimizer steps by episode; each
        step minimises `sft_loss`, the mean cross-entropy over the mini-batch's loss-mask-1 tokens (tokens scored
        at temperature 1 without a nucleus, whatever the recorded call sampled with).

        Returns: sft_loss (the mean cross-entropy, nats per token, of the first optimizer step's mini-batch
        before it moved the weights: with one mini-batch, the loss of the step's samples under the weights
        the step started from), loss (the mean of every optimizer step's), grad_norm (mean), sft_tokens
        (loss tokens in the step), optimizer_steps, update_s.
        """
        alg = self.cfg.algorithm
        t0 = time.perf_counter()
        trainable = [s for s in samples if s.num_loss_tokens > 0]
        if not trainable:
            return {"update_s": 0.0, "optimizer_steps": 0.0}
        episodes = sorted({s.episode_id for s in trainable})
        losses, norms, skipped = [], [], 0
        with self._weights_held():
            self.model.train()
            for _ in range(alg.ppo_epochs):
                self._rng.shuffle(episodes)
                for mb_eps in split_mini_batches(episodes, alg.mini_batches):
                    chosen = set(mb_eps)
                    mb = [s for s in trainable if s.episode_id in chosen]
                    weights = loss_token_weights(list(range(len(mb))), [s.num_loss_tokens for s in mb], "token-mean")
                    self.optimizer.zero_grad(set_to_none=True)
                    total = 0.0
                    for micro in self._micro_batches(list(zip(mb, weights))):
                        batch = _collate([s for s, _ in micro], [w for _, w in micro], self.tokenizer.pad_token_id,
                                         self.device)
                        logprobs, _ = token_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                                     torch.ones_like(batch["temperatures"]),
                                                     score_mask=batch["loss_mask"],
                                                     share_prefixes=self._packed_row_tokens)
                        loss = sft_loss(logprobs, batch["weights"])
                        loss.backward()
                        total += float(loss.detach())
                    norm = float(torch.nn.utils.clip_grad_norm_(
                        [p for p in self.model.parameters() if p.requires_grad], alg.max_grad_norm))
                    bad = nonfinite_figure({"loss": total, "grad_norm": norm})
                    if bad is not None:   # never step on NaN / inf
                        report_nonfinite(f"the debug backbone's fine-tuning of policy version "
                                         f"{self.engine.policy_version}", bad)
                        skipped, norm, total = skipped + 1, 0.0, 0.0
                    else:
                        self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    norms.append(norm)
                    losses.append(total)
            self.model.eval()
            synced = self._trained(self.engine.policy_version + 1)
        return {"sft_loss": losses[0], "loss": sum(losses) / len(losses), "grad_norm": sum(norms) / len(norms),
                "sft_tokens": float(sum(s.num_loss_tokens for s in trainable)), "optimizer_steps": float(len(losses)),
                NONFINITE_SKIPPED: float(skipped),
                **synced, "update_s": time.perf_counter() - t0}

    def _publish_weights(self, version: int) -> dict[str, float]:
        """Serve the weights the update just trained as policy `version`: the in-process engine generates with them
        already; a vLLM engine reloads them (`VLLMEngine.sync_weights`), or with LoRA loads the adapters alone under
        new names (`VLLMEngine.sync_adapters`), and its figures (`weight_sync_s`, `weight_save_s`,
        `weight_reload_s`, seconds) are returned for the step's metrics: `ajet.engines.vllm.publish_weights`, the
        sync the verl and trinity backbones do too.
        Raises RuntimeError when a vLLM server fails the reload."""
        from ajet.engines.vllm import publish_weights

        return publish_weights(self.engine, version, self._served_state_dict, self._write_adapters)

    def _lora_served(self) -> bool:
        """Whether the policy is LoRA adapters (`model.lora` or `agents:`): a vLLM server then serves the base model
        and loads the adapters."""
        return self.cfg.model.lora is not None or bool(self.adapters)

    def _write_adapters(self, folder: Path) -> None:
        """Write each adapter (`default` for `model.lora`) in peft's format into `folder/<adapter>/`."""
        save_adapters(self.model, folder, self.adapters or ["default"])

    def _served_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a vLLM server starts from, under the base model's Hugging Face names: the policy's, or with
        LoRA the frozen base model's (the adapters are loaded by name)."""
        return base_state_dict(self.model) if self._lora_served() else self.model.state_dict()

    def _optimizer_step(self, samples: list[Sample]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.accumulate_gradients(samples)
        if stats["_tokens"] == 0:  # every advantage is 0: nothing to learn from this mini-batch
            return {**stats, "grad_norm": 0.0, NONFINITE_SKIPPED: 0.0}
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._trained_parameters(), self.cfg.algorithm.max_grad_norm))
        bad = nonfinite_figure({**stats, "grad_norm": grad_norm})
        if bad is not None:        # never step on NaN / inf: weights and optimizer state stay as they are
            self.optimizer.zero_grad(set_to_none=True)
            report_nonfinite(f"the debug backbone's update of policy version {self.engine.policy_version}", bad)
            return {**{k: 0.0 for k in stats}, "grad_norm": 0.0, NONFINITE_SKIPPED: 1.0}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**stats, "grad_norm": grad_norm, NONFINITE_SKIPPED: 0.0}

    @property
    def _packed_row_tokens(self) -> int | None:
        """`token_logprobs`' share_prefixes: the micro-batch budget (tokens) with `share_prefixes`, else None."""
        return self.cfg.algorithm.micro_batch_tokens if self.share_prefixes else None

    def _micro_batches(self, items: list) -> list[list]:
        """(sample, weight) pairs in micro-batches of `algorithm.micro_batch_tokens` (`_micro_batches`)."""
        return _micro_batches(items, self.cfg.algorithm.micro_batch_tokens, self.share_prefixes)

    def _trained_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters `self.optimizer` steps (the whole trainable policy, or one adapter's LoRA weights)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _forwarded(self, sample: Sample) -> bool:
        """Whether the loss needs a forward of `sample`: a token with advantage 0 adds exactly 0 to the PPO
        loss and its gradient, so without a KL term such samples are skipped (after the weights were
        computed over all of them, so the loss is unchanged)."""
        return sample.advantage != 0.0 or self.cfg.algorithm.kl_coef > 0 or self.teacher is not None

    def accumulate_gradients(self, samples: list[Sample]) -> dict[str, float]:
        """Backward the GRPO loss of `samples` (one mini-batch) into `.grad`, micro-batch by micro-batch.

        Per-token weights come from `loss_token_weights` over all of `samples` (a sequence = an episode, or
        a sample with `algorithm.episode_weight: sample`),
        so the summed gradient is exactly the `algorithm.loss_agg_mode` aggregate of the mini-batch,
        however the episodes were split into samples and micro-batches.

        Returns:
            loss, pg_loss, kl (aggregates); clip_frac, dual_clip_frac, ratio_mean, weight_sum (weighted
            sums, see `ppo_clip_loss`); with is_cap is_weight_mean, is_capped_frac and _is_weight_sum (sums
            of w_t is_t, w_t [is_t at the cap] and w_t, w_t the aggregation weight); _entropy, _logprob_diff
            (sums over loss tokens of this forward, under the weights before this backward) and _tokens (how many).
        """
        alg = self.cfg.algorithm
        # a "sequence" of the seq-mean-* modes: the episode (however many samples it forked into), or each sample
        seq_ids = [s.episode_id if alg.episode_weight == "episode" else i for i, s in enumerate(samples)]
        weights = loss_token_weights(seq_ids, [s.num_loss_tokens for s in samples],
                                     alg.loss_agg_mode, alg.loss_scale_factor,
                                     max(len(s.response_ids) for s in samples) if samples else None)
        stats = dict.fromkeys(("loss", "pg_loss", "kl", "clip_frac", "dual_clip_frac", "ratio_mean", "weight_sum",
                               "_entropy", "_logprob_diff", "_tokens") + (("distill/kl",) if self.teacher is not None else ()), 0.0)
        if self.is_cap is not None:
            stats.update(is_weight_mean=0.0, is_capped_frac=0.0, _is_weight_sum=0.0)
        items = [(s, w) for s, w in zip(samples, weights) if self._forwarded(s)]
        per_token = {"prox_logprobs": self._prox} if self._prox is not None else {}
        if isinstance(self.teacher, RemoteTeacher):   # fetched by `update` once; a direct call fetches its own
            per_token["teacher_logprobs"] = (self._teacher_lp
                                             or _remote_teacher_logprobs(self.teacher, [s for s, _ in items]))
        for micro in self._micro_batches(items):
            batch = _collate([s for s, _ in micro], [w for _, w in micro], self.tokenizer.pad_token_id, self.device,
                             per_token)
            logprobs, entropy = token_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                               batch["temperatures"], batch["top_ps"], with_entropy=True,
                                               score_mask=batch["loss_mask"], share_prefixes=self._packed_row_tokens)
            ref = self._ref_logprobs(batch) if alg.kl_coef > 0 else None
            old, weights = batch["old_logprobs"], batch["weights"]
            if self.is_cap is not None:   # off-policy tokens: ratio against pi_prox, loss weighted by pi_prox / pi_old
                prox = batch.get("prox_logprobs", logprobs.detach())
                is_w = truncated_is_weights(prox, old, self.is_cap, batch["loss_mask"])
                old, weights = prox, weights * is_w
                stats["is_weight_mean"] += float((batch["weights"] * is_w).sum())
                stats["is_capped_frac"] += float((batch["weights"] * (is_w >= self.is_cap)).sum())
                stats["_is_weight_sum"] += float(batch["weights"].sum())   # the means' denominator: not IS-weighted
            loss, s = ppo_clip_loss(logprobs, old, batch["advantages"], weights,
                                    alg.clip_ratio_low, alg.clip_ratio_high, ref, alg.kl_coef, alg.clip_ratio_c)
            if self.teacher is not None:   # on-policy distillation: the teacher scores the student's tokens
                teacher = batch.get("teacher_logprobs")
                if teacher is None:
                    with torch.no_grad():
                        teacher, _ = token_logprobs(self.teacher, batch["input_ids"], batch["attention_mask"],
                                                    batch["temperatures"], batch["top_ps"],
                                                    score_mask=batch["loss_mask"],
                                                    share_prefixes=self._packed_row_tokens)
                d_loss, s["distill/kl"] = distill_loss(logprobs, batch["old_logprobs"], teacher, batch["weights"])
                d = alg.distill
                loss = d.coef * d_loss if d.mode == "replace" else loss + d.coef * d_loss
            loss.backward()
            for k, v in s.items():
                stats[k] += v
            stats["loss"] += float(loss.detach())
            for k, v in _first_pass_sums(logprobs.detach(), entropy, batch).items():
                stats[k] += v
        return stats

    @torch.no_grad()
    def _ref_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """`[batch, seq]` logprobs under the reference policy: the initial weights (a frozen copy), or with LoRA
        the base model, i.e. this model with its adapter disabled."""
        if self.lora:
            with self.model.disable_adapter():
                ref, _ = token_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                        batch["temperatures"], batch["top_ps"], score_mask=batch["loss_mask"],
                                        share_prefixes=self._packed_row_tokens)
            return ref
        ref, _ = token_logprobs(self.ref_model, batch["input_ids"], batch["attention_mask"],
                                batch["temperatures"], batch["top_ps"], score_mask=batch["loss_mask"],
                                share_prefixes=self._packed_row_tokens)
        return ref

    @torch.no_grad()
    def _proximal_logprobs(self, samples: list[Sample]) -> dict[int, list[float]]:
        """id(sample) -> log pi_prox of each of its response tokens `[response_len]` (0 where not trained) under
        the weights before the update: the PPO ratio's denominator when one update takes several optimizer
        steps (asynchronous training)."""
        out: dict[int, list[float]] = {}
        items = [(s, 1.0) for s in samples if self._forwarded(s)]
        self.model.eval()
        for micro in self._micro_batches(items):
            batch = _collate([s for s, _ in micro], [w for _, w in micro], self.tokenizer.pad_token_id, self.device)
            logprobs, _ = token_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                         batch["temperatures"], batch["top_ps"], score_mask=batch["loss_mask"],
                                         share_prefixes=self._packed_row_tokens)
            for i, (s, _) in enumerate(micro):
                P = len(s.prompt_ids)
                out[id(s)] = logprobs[i, P:P + len(s.response_ids)].tolist()
        self.model.train()
        return out

    @torch.no_grad()
    def measure(self, samples: list[Sample]) -> dict[str, float]:
        """entropy and logprob_diff of the forwarded loss tokens of `samples` under the current weights
        (token means, no gradient): the rollout-vs-trainer agreement before an update moves anything."""
        sums = {"_entropy": 0.0, "_logprob_diff": 0.0, "_tokens": 0.0}
        items = [(s, 1.0) for s in samples if self._forwarded(s)]
        self.model.eval()
        for micro in self._micro_batches(items):
            batch = _collate([s for s, _ in micro], [w for _, w in micro], self.tokenizer.pad_token_id, self.device)
            logprobs, entropy = token_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                               batch["temperatures"], batch["top_ps"], with_entropy=True,
                                               score_mask=batch["loss_mask"], share_prefixes=self._packed_row_tokens)
            for k, v in _first_pass_sums(logprobs, entropy, batch).items():
                sums[k] += v
        n = sums["_tokens"]
        return {"entropy": sums["_entropy"] / n if n else 0.0, "logprob_diff": sums["_logprob_diff"] / n if n else 0.0}

    # ---- rollout servers ----------------------------------------------------------------------------
    def sleep_rollout(self) -> None:
        """No-op: the engine generates with the very weights the update trains."""

    def wake_rollout(self) -> None:
        """No-op (see `sleep_rollout`)."""

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """Hugging Face format (`AutoModelForCausalLM.from_pretrained(path)` loads it; with LoRA the adapters
        merged in, and the adapter alone in `path/adapter`, which `peft.PeftModel.from_pretrained` loads onto
        the base model), plus `backbone_state.pt`: optimizer state, sampler RNG and policy version.

        With `agents:` the folder holds the base model (unmerged: every role has its own adapter) and one peft
        folder per adapter, `path/adapters/<name>/` (`peft.PeftModel.from_pretrained(base, folder)`, vLLM
        `--lora-modules <name>=<folder>`); `backbone_state.pt` holds each adapter's optimizer state."""
        path.mkdir(parents=True, exist_ok=True)
        with self._weights_held():
            if self.adapters:
                save_adapters(self.model, path / ADAPTERS_DIR, self.adapters)
                self.model.get_base_model().save_pretrained(path, state_dict=base_state_dict(self.model))
            elif self.lora:
                self.model.save_pretrained(path / "adapter")
                self.model.get_base_model().save_pretrained(path, state_dict=merged_lora_state_dict(self.model))
            else:
                self.model.save_pretrained(path)
            optimizers = ({"optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()}}
                          if self.adapters else {"optimizer": self.optimizer.state_dict()})
            engine_rng = self.engine.rng_state() if isinstance(self.engine, HFEngine) else None
            # the weights written are the trainer's copy: a candidate not yet switched in (the gateway writes a
            # version before it serves it) is saved as its own version
            version = self.engine.policy_version if self.candidate_version is None else self.candidate_version
            torch.save({**optimizers, "engine_rng": engine_rng,
                        "update_rng": self._rng.getstate(), "policy_version": version},
                       path / "backbone_state.pt")
        self.tokenizer.save_pretrained(path)

    def load_checkpoint(self, path: Path, serve: bool = True) -> None:
        """Restore weights, optimizer(s), RNG and policy version written by `save_checkpoint` (with `agents:`
        every adapter and its optimizer).

        With serving while training the weights go into the trainer's copy, then (`serve`) into the served copy
        by a switch; `serve=False` only brings the trainer back (a refused candidate dropped: the served weights
        and the engine's sampler stay as they are).

        Raises:
            ConfigError: the checkpoint was written by a run with other adapters (or none) than this config's."""
        from transformers import AutoModelForCausalLM

        state = torch.load(path / "backbone_state.pt", weights_only=False)
        saved_adapters = sorted(state.get("optimizers", {}))
        if sorted(n for n in self.optimizers if n is not None) != saved_adapters:
            raise ConfigError(f"agents: the checkpoint {path} holds the adapters "
                              f"{saved_adapters or 'none (one policy)'}, this config {self.adapters or 'none (one policy)'}"
                              f": resume with the config it was written with")
        with self._weights_held():
            if self.adapters:
                load_adapters(self.model, path / ADAPTERS_DIR, self.adapters)
                for name, opt in self.optimizers.items():
                    opt.load_state_dict(state["optimizers"][name])
            elif self.lora:   # the base weights never train: restoring the adapter restores the policy
                from peft import set_peft_model_state_dict
                from safetensors.torch import load_file

                set_peft_model_state_dict(self.model, load_file(str(path / "adapter" / "adapter_model.safetensors")))
            else:
                saved = AutoModelForCausalLM.from_pretrained(path, dtype=next(self.model.parameters()).dtype)
                self.model.load_state_dict(saved.state_dict())
            if not self.adapters:
                self.optimizer.load_state_dict(state["optimizer"])
            self._rng.setstate(state["update_rng"])
            if not self.serves_while_training:
                if isinstance(self.engine, HFEngine) and state["engine_rng"] is not None:
                    self.engine.set_rng_state(state["engine_rng"])
                self._publish_weights(state["policy_version"])
        self.candidate_version = None
        if self.serves_while_training and serve:
            if isinstance(self.engine, HFEngine) and state["engine_rng"] is not None:
                self.engine.set_rng_state(state["engine_rng"])
            self._serve(state["policy_version"])

    def close(self) -> None:
        self.engine.close()
        if self._trainer_engine is not None:
            self._trainer_engine.close()
        if isinstance(self.teacher, RemoteTeacher):
            self.teacher.close()


def _load_teacher(cfg: AjetConfig, student):
    """The frozen teacher of `algorithm.distill`: a local model folder (on the student's device), or a
    `RemoteTeacher` for a URL.

    A URL teacher with `rollout.temperature` or `top_p` other than 1 logs a warning naming both temperatures:
    the server's prompt logprobs are at temperature 1, so the KL is to the teacher at temperature 1.

    Raises:
        ConfigError: a local teacher's vocabulary differs from the student's (the teacher must score the
            student's token ids).
        RuntimeError: a URL teacher without `teacher_model` whose /models cannot be read.
    """
    path = cfg.algorithm.distill.teacher
    if path.startswith(("http://", "https://")):
        r = cfg.rollout
        if r.temperature != 1.0 or r.top_p != 1.0:
            logging.getLogger(__name__).warning(
                "algorithm.distill.teacher %s is a URL: its server scores tokens at temperature 1 without top_p "
                "(vLLM's prompt logprobs), while the rollout samples at rollout.temperature %s (top_p %s). "
                "distill/kl and its gradient are then the KL from the student at temperature %s to the teacher at "
                "temperature 1, not to the teacher at %s; a teacher folder is scored at the rollout's temperature "
                "and top_p", path, r.temperature, r.top_p, r.temperature, r.temperature)
        return RemoteTeacher(path, cfg.algorithm.distill.teacher_model)
    teacher = load_model(resolve_model_path(path, require="weights"), cfg.model.dtype, cfg.model.device)
    teacher = teacher.eval().requires_grad_(False)
    sv, tv = student.get_output_embeddings().weight.shape[0], teacher.get_output_embeddings().weight.shape[0]
    if sv != tv:
        raise ConfigError(f"algorithm.distill.teacher {path!r} has a vocabulary of {tv} ids, the student {sv}: the "
                          f"teacher must share the student's tokenizer")
    return teacher


def enable_activation_checkpointing(model) -> None:
    """Checkpoint every decoder layer of `model` in training mode (transformers' activation checkpointing, the
    non-reentrant `torch.utils.checkpoint`): a training forward keeps only each layer's input, `[batch, seq,
    hidden]`, and the backward recomputes the layer's activations from it. The recomputation runs the same
    operations on the same inputs, so losses and gradients are bit-identical to a forward that keeps every
    activation; the cost is one more forward of the body per backward. The engine's generation (eval mode,
    no gradient) is unaffected. A PEFT-wrapped model is enabled through its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):      # transformers >= 5.2x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "enable_input_require_grads") and base is not model:
        model.enable_input_require_grads()   # frozen embeddings (LoRA): the checkpointed layers still get a grad path


def _with_lora(model, lora):
    """`model` wrapped by peft with trainable LoRA adapters (base weights frozen)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                            lora_dropout=lora.dropout, task_type="CAUSAL_LM"))


@torch.no_grad()
def merged_lora_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA delta (scale * B @ A, peft's `get_delta_weight`) added to
    the weight it adapts: what `merge_and_unload` would save, without touching (or copying) the live model.
    Keys are the base model's own, so `AutoModelForCausalLM.from_pretrained` loads the result."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    deltas = {name: m.get_delta_weight(m.active_adapters[0]) for name, m in base.named_modules()
              if isinstance(m, LoraLayer) and m.active_adapters}
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        module, _, leaf = key.replace(".base_layer", "").rpartition(".")
        out[f"{module}.{leaf}"] = value + deltas[module].to(value.dtype) if leaf == "weight" and module in deltas \
            else value
    return out


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperatures: torch.Tensor,
                   top_ps: torch.Tensor | None = None, with_entropy: bool = False,
                   score_mask: torch.Tensor | None = None, share_prefixes: int | None = None):
    """log pi(x_t | x_<t) of the scored tokens under the distribution each was sampled from.

    Each scored token is scored with its own temperature and top_p through
    `ajet.sampling_dist.processed_logprobs` (the engine records old logprobs under the same function), so a
    sample that merges calls made at different temperatures gets ratio 1 on fresh data. A temperature of 0
    (a greedy call, trained only under `algorithm.train_greedy_calls`) is scored at T = 1 and top_p = 1,
    whatever top_p the call asked for (the engine records a greedy token's logprob so).

    Only where trained: the transformer body runs over every position (attention needs the whole
    sequence), but the final hidden states are gathered at the N positions that predict a scored token
    before the LM head, so the `[N, vocab]` logits, the processed log-softmax (and its nucleus sort) and the
    entropy are computed for those tokens only, not for the `[batch, seq, vocab]` of every prompt, tool
    result and padding position. Per scored token the result is the same as the full computation
    (`model(...).logits` then `processed_logprobs` everywhere) up to float rounding.

    Args:
        model: a causal LM whose logits are `get_output_embeddings()(get_decoder()(...).last_hidden_state)`,
            plus the scaling `_lm_head` applies when its config sets one (Llama, SmolLM2, Qwen2, Mistral,
            Gemma 2, Granite, Cohere; a PEFT-wrapped one resolves both through its base model).
        input_ids: `[batch, seq]` right-padded sequences.
        attention_mask: `[batch, seq]` 1 on real tokens.
        temperatures: `[batch, seq]` temperature that sampled token t (1.0 on prompt and padding);
            `[batch, 1]` applies one temperature to a whole row.
        top_ps: like temperatures, the nucleus mass (None: 1.0, no truncation).
        with_entropy: also return the entropy (nats) of the processed distribution at each scored token.
        score_mask: `[batch, seq]` nonzero at the tokens to score (the trainer passes the loss mask: the
            loss weights, the KL term and the logprob_diff / entropy metrics all live there); None scores
            every token 1..seq-1 (the full computation).
        share_prefixes: pack sequences that share a prefix (a GRPO group's prompt) into rows of at most this many
            tokens, the prefix run once per row (`backbones/debug/shared_prefix.py`); the same values up to float
            rounding. None, or a model `supports_packing` refuses: one row per sequence.

    Returns:
        (logprobs, entropy): `[batch, seq]` each; position t holds the value for token t (predicted from
        position t-1); position 0 and unscored positions hold 0. A token outside its nucleus gets -inf.
        entropy is None unless with_entropy. logprobs is differentiable at the scored positions.
    """
    B, S = input_ids.shape
    want = torch.ones((B, S), dtype=torch.bool, device=input_ids.device) if score_mask is None \
        else score_mask.to(device=input_ids.device).bool().clone()
    want[:, 0] = False                                                          # token 0 has no prediction
    rows, cols = want.nonzero(as_tuple=True)                                    # [N], [N]: the scored tokens
    temps = temperatures.expand(B, S)[rows, cols]                               # [N]
    greedy = temps <= 0                  # greedy: scored at T = 1 without a nucleus, as the engine records it
    temps = torch.where(greedy, torch.ones_like(temps), temps)
    tops = None if top_ps is None else torch.where(greedy, torch.ones_like(temps), top_ps.expand(B, S)[rows, cols])
    packed = None
    if share_prefixes and supports_packing(model):
        packed = pack(input_ids, attention_mask, share_prefixes, dtype=model.get_output_embeddings().weight.dtype)
    if packed is None:
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                     use_cache=False).last_hidden_state         # [B, S, H]
        before = hidden[rows, cols - 1]                                         # [N, H]: token t from t-1
    else:                                                                       # [R, L, H] -> [R * L, H]
        hidden = model.get_decoder()(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                                     position_ids=packed.position_ids, use_cache=False).last_hidden_state
        before = hidden.flatten(0, 1)[packed.index[rows, cols - 1]]             # [N, H]
    logits = _lm_head(model, before)                                            # [N, V]
    logp_all = processed_logprobs(logits, temps, tops)                          # [N, V]
    lp_n = logp_all.gather(-1, input_ids[rows, cols, None]).squeeze(-1)         # [N]
    lp = torch.zeros((B, S), dtype=lp_n.dtype, device=lp_n.device).index_put((rows, cols), lp_n)
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = torch.zeros_like(lp).index_put((rows, cols), entropy(logp_all))
    return lp, ent


def _lm_head(model, hidden: torch.Tensor) -> torch.Tensor:
    """`[N, vocab]` logits of `[N, hidden]` final hidden states: what the causal LM's forward applies after
    its decoder: the output embedding, then the model's own logit scaling when its config sets one (Granite
    divides by `logits_scaling`, Cohere multiplies by `logit_scale`, as their transformers forwards do), then
    Gemma 2's tanh softcap (`final_logit_softcapping`)."""
    logits = model.get_output_embeddings()(hidden)
    if scaling := getattr(model.config, "logits_scaling", None):     # Granite, GraniteMoe
        logits = logits / scaling
    if scale := getattr(model.config, "logit_scale", None):          # Cohere, Cohere2
        logits = logits * scale
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def _first_pass_sums(logprobs: torch.Tensor, ent: torch.Tensor, batch: dict) -> dict[str, float]:
    """Sums over the loss tokens of one micro-batch: entropy, |trainer - engine| logprob, token count."""
    m = batch["loss_mask"].bool()
    return {"_entropy": float(ent[m].sum()), "_logprob_diff": float((logprobs - batch["old_logprobs"]).abs()[m].sum()),
            "_tokens": float(m.sum())}


def _remote_teacher_logprobs(teacher: RemoteTeacher, samples: list[Sample]) -> dict[int, list[float]]:
    """id(sample) -> log pi_teacher of each of its response tokens `[response_len]`, from the teacher's server."""
    scored = teacher.score_many([(s.input_ids, len(s.prompt_ids)) for s in samples])
    return {id(s): lp for s, lp in zip(samples, scored)}


def _collate(samples: list[Sample], weights: list[float], pad_id: int, device,
             per_token: dict[str, dict[int, list[float]]] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad samples into `[batch, seq]` tensors aligned to full sequences (prompt part zero-weighted);
    each `per_token` entry (name -> id(sample) -> `[response_len]` values, e.g. `prox_logprobs`) becomes one more
    `[batch, seq]` tensor of that name (0 outside the responses)."""
    S = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    B = len(samples)
    out = {k: torch.zeros((B, S), dtype=torch.float32) for k in ("old_logprobs", "advantages", "weights", "loss_mask")}
    out.update({k: torch.ones((B, S), dtype=torch.float32) for k in ("temperatures", "top_ps")})
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attn = torch.zeros((B, S), dtype=torch.long)
    for i, (s, w) in enumerate(zip(samples, weights)):
        P, R = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :P + R] = torch.tensor(s.input_ids)
        attn[i, :P + R] = 1
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        out["loss_mask"][i, P:P + R] = mask
        out["old_logprobs"][i, P:P + R] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        out["advantages"][i, P:P + R] = s.advantage
        out["weights"][i, P:P + R] = w * mask
        out["temperatures"][i, P:P + R] = torch.tensor(s.temperatures, dtype=torch.float32)
        out["top_ps"][i, P:P + R] = torch.tensor(s.top_ps, dtype=torch.float32)
        for name, values in (per_token or {}).items():
            out.setdefault(name, torch.zeros((B, S), dtype=torch.float32))[i, P:P + R] = \
                torch.tensor(values[id(s)], dtype=torch.float32)
    out.update(input_ids=input_ids, attention_mask=attn)
    return {k: v.to(device) for k, v in out.items()}


def _micro_batches(items: list, max_tokens: int, share_prefixes: bool = False) -> list[list]:
    """Greedy packing of (sample, weight) pairs, longest first, into chunks of <= max_tokens padded tokens.

    share_prefixes: the units are packed rows (`shared_prefix.pack_rows` over all items, rows of at most
    max_tokens tokens): a chunk holds whole rows, <= max_tokens counting each row padded to its chunk's longest;
    `token_logprobs(..., share_prefixes=max_tokens)` packs each chunk's sequences by the same rule."""
    if share_prefixes:
        rows = pack_rows([s.input_ids for s, _ in items], max_tokens)
        units = [([items[i] for i in r.members], r.length) for r in rows]
        return _chunks(sorted(units, key=lambda u: -u[1]), max_tokens)
    return _chunks([([it], len(it[0].input_ids)) for it in sorted(items, key=lambda it: -len(it[0].input_ids))],
                   max_tokens)


def _chunks(units: list[tuple[list, int]], max_tokens: int) -> list[list]:
    """(items, tokens) units, longest first, into chunks whose count x longest is <= max_tokens (a longer unit
    alone); returns each chunk's items."""
    chunks, cur, cur_max = [], [], 0
    for members, n in units:
        if cur and max(cur_max, n) * (len(cur) + 1) > max_tokens:
            chunks.append([it for m in cur for it in m])
            cur, cur_max = [], 0
        cur.append(members)
        cur_max = max(cur_max, n)
    if cur:
        chunks.append([it for m in cur for it in m])
    return chunks
