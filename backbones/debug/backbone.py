"""The debug backbone: the policy, its engine and a GRPO update, all in this process.

One model object both generates (`HFEngine`) and trains, so the next step's rollouts use the updated
weights without a copy. Breakpoints work anywhere (no Ray, no subprocesses).
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import torch

from ajet.backbones.debug.engine import HFEngine
from ajet.config import AjetConfig
from ajet.grpo import episode_token_weights, ppo_clip_loss
from ajet.model import load_model, load_tokenizer, resolve_model_path
from ajet.tracker.sample import Sample


class DebugBackbone:
    """Single-process backbone. See `ajet.backbones.base.Backbone` for the protocol.

    Args:
        cfg: the experiment config (model, rollout, algorithm sections are read).
    """

    def __init__(self, cfg: AjetConfig):
        self.cfg = cfg
        path = resolve_model_path(cfg.model.path)
        self.tokenizer = load_tokenizer(path, cfg.model.chat_template)
        self.model = load_model(path, cfg.model.dtype, cfg.model.device)
        self.model.config.use_cache = True
        self.device = next(self.model.parameters()).device
        eos = {self.tokenizer.eos_token_id}
        if self.model.generation_config is not None and self.model.generation_config.eos_token_id is not None:
            g = self.model.generation_config.eos_token_id
            eos |= set(g if isinstance(g, list) else [g])
        self.engine = HFEngine(self.model, sorted(eos), self.tokenizer.pad_token_id,
                               max_batch_size=cfg.rollout.max_batch_size, max_model_len=cfg.model.max_model_len,
                               decode_fn=self.tokenizer.decode)
        self.engine.seed(cfg.trainer.seed)
        alg = cfg.algorithm
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=alg.lr, weight_decay=alg.weight_decay)
        self.ref_model = None
        if alg.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._rng = random.Random(cfg.trainer.seed)

    # ---- the RL step ------------------------------------------------------------------------------
    def update(self, samples: list[Sample]) -> dict[str, float]:
        """PPO-clip epochs over `samples`, split into `mini_batches` optimizer steps by episode.

        Every sample must carry its episode's advantage. Returns mean metrics over optimizer steps:
        loss, pg_loss, kl, clip_frac, ratio_mean, grad_norm, entropy, logprob_diff (mean |trainer -
        engine| logprob on the first pass: 0 up to numerics when rollout and training agree), update_s.
        """
        alg = self.cfg.algorithm
        t0 = time.perf_counter()
        trainable = [s for s in samples if s.num_loss_tokens > 0]
        if not trainable:
            return {"update_s": 0.0, "optimizer_steps": 0.0}
        episodes = sorted({s.episode_id for s in trainable})
        totals: dict[str, float] = {}
        steps = 0
        with self.engine.weights_lock:
            self.model.train()
            for epoch in range(alg.ppo_epochs):
                self._rng.shuffle(episodes)
                for mb_eps in _split(episodes, alg.mini_batches):
                    chosen = set(mb_eps)
                    stats = self._optimizer_step([s for s in trainable if s.episode_id in chosen],
                                                 first_pass=(epoch == 0))
                    for k, v in stats.items():
                        totals[k] = totals.get(k, 0.0) + v
                    steps += 1
            self.model.eval()
            self.engine.policy_version += 1
        out = {k: v / steps for k, v in totals.items()}
        out.update(update_s=time.perf_counter() - t0, optimizer_steps=float(steps))
        return out

    def _optimizer_step(self, samples: list[Sample], first_pass: bool) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.accumulate_gradients(samples, first_pass)
        if stats.pop("_tokens") == 0:  # every advantage is 0: nothing to learn from this mini-batch
            return {**stats, "grad_norm": 0.0}
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.algorithm.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**stats, "grad_norm": float(grad_norm)}

    def accumulate_gradients(self, samples: list[Sample], first_pass: bool = True) -> dict[str, float]:
        """Backward the GRPO loss of `samples` (one mini-batch) into `.grad`, micro-batch by micro-batch.

        Per-token weights come from `episode_token_weights` over all of `samples`, so the summed gradient
        is the mean over episodes of each episode's token-mean loss, however the episodes were split into
        samples and micro-batches.
        """
        alg = self.cfg.algorithm
        weights = episode_token_weights([s.episode_id for s in samples], [s.num_loss_tokens for s in samples])
        stats: dict[str, float] = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0,
                                   "entropy": 0.0}
        diff_sum, diff_n, mass = 0.0, 0, 0.0
        # a token with advantage 0 adds exactly 0 to the PPO loss (and its gradient); without a KL term
        # it is skipped here, after the weights were computed over all episodes, so the loss is unchanged
        items = [(s, w) for s, w in zip(samples, weights) if s.advantage != 0.0 or self.ref_model is not None]
        for micro in _micro_batches(items, alg.micro_batch_tokens):
            batch = _collate([s for s, _ in micro], [w for _, w in micro], self.tokenizer.pad_token_id, self.device)
            logprobs, entropy = token_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                               batch["temperature"], with_entropy=True)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = token_logprobs(self.ref_model, batch["input_ids"], batch["attention_mask"],
                                            batch["temperature"])
            loss, s = ppo_clip_loss(logprobs, batch["old_logprobs"], batch["advantages"], batch["weights"],
                                    alg.clip_ratio_low, alg.clip_ratio_high, ref, alg.kl_coef)
            loss.backward()
            for k in ("pg_loss", "kl", "clip_frac", "ratio_mean"):
                stats[k] += s[k]
            stats["loss"] += float(loss.detach())
            with torch.no_grad():
                stats["entropy"] += float((batch["weights"] * entropy).sum())
                mass += float(batch["weights"].sum())
                if first_pass:
                    m = batch["loss_mask"].bool()
                    diff_sum += float((logprobs.detach() - batch["old_logprobs"]).abs()[m].sum())
                    diff_n += int(m.sum())
        for k in ("clip_frac", "ratio_mean", "entropy"):  # weighted means over the tokens actually trained
            stats[k] = stats[k] / mass if mass > 0 else 0.0
        if first_pass and diff_n:
            stats["logprob_diff"] = diff_sum / diff_n
        stats["_tokens"] = sum(s.num_loss_tokens for s, _ in items)
        return stats

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """Hugging Face format (`AutoModelForCausalLM.from_pretrained(path)` loads it), plus
        `backbone_state.pt`: optimizer state, sampler RNG and policy version, for `load_checkpoint`."""
        path.mkdir(parents=True, exist_ok=True)
        with self.engine.weights_lock:
            self.model.save_pretrained(path)
            torch.save({"optimizer": self.optimizer.state_dict(), "engine_rng": self.engine._generator.get_state(),
                        "update_rng": self._rng.getstate(), "policy_version": self.engine.policy_version},
                       path / "backbone_state.pt")
        self.tokenizer.save_pretrained(path)

    def load_checkpoint(self, path: Path) -> None:
        """Restore weights, optimizer, RNG and policy version written by `save_checkpoint`."""
        from transformers import AutoModelForCausalLM

        state = torch.load(path / "backbone_state.pt", weights_only=False)
        saved = AutoModelForCausalLM.from_pretrained(path, dtype=next(self.model.parameters()).dtype)
        with self.engine.weights_lock:
            self.model.load_state_dict(saved.state_dict())
            self.optimizer.load_state_dict(state["optimizer"])
            self.engine._generator.set_state(state["engine_rng"])
            self._rng.setstate(state["update_rng"])
            self.engine.policy_version = state["policy_version"]

    def close(self) -> None:
        self.engine.close()


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: torch.Tensor,
                   with_entropy: bool = False):
    """log pi(x_t | x_<t) of every token, under logits / temperature.

    Args:
        input_ids: `[batch, seq]` right-padded sequences.
        attention_mask: `[batch, seq]` 1 on real tokens.
        temperature: `[batch, 1]` the sampling temperature of each sequence.
    Returns:
        (logprobs, entropy): `[batch, seq]` each; position t holds the value for token t (predicted from
        position t-1); position 0 is 0. entropy is None unless with_entropy.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, S, V]
    logits = logits[:, :-1, :].float() / temperature.unsqueeze(-1)                                # [B, S-1, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)                                 # [B, S-1]
    lp = torch.nn.functional.pad(lp, (1, 0))
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = torch.nn.functional.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0))
    return lp, ent


def _collate(samples: list[Sample], weights: list[float], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-pad samples into `[batch, seq]` tensors aligned to full sequences (prompt part zero-weighted)."""
    S = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    B = len(samples)
    out = {k: torch.zeros((B, S), dtype=torch.float32) for k in ("old_logprobs", "advantages", "weights", "loss_mask")}
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
    out.update(input_ids=input_ids, attention_mask=attn,
               temperature=torch.tensor([[s.temperature] for s in samples], dtype=torch.float32))
    return {k: v.to(device) for k, v in out.items()}


def _micro_batches(items: list, max_tokens: int) -> list[list]:
    """Greedy packing of (sample, weight) pairs, longest first, into chunks of <= max_tokens padded tokens."""
    items = sorted(items, key=lambda it: -len(it[0].input_ids))
    chunks, cur, cur_max = [], [], 0
    for it in items:
        n = len(it[0].input_ids)
        if cur and max(cur_max, n) * (len(cur) + 1) > max_tokens:
            chunks.append(cur)
            cur, cur_max = [], 0
        cur.append(it)
        cur_max = max(cur_max, n)
    if cur:
        chunks.append(cur)
    return chunks


def _split(items: list, n: int) -> list[list]:
    n = max(1, min(n, len(items)))
    return [items[i::n] for i in range(n)]
