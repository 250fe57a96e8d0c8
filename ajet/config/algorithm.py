"""The update's algorithm: `algorithm:` (advantage, PPO-clip loss, optimizer) and its sub-sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ajet.config.base import _Section


class DynamicSamplingConfig(_Section):
    """DAPO's dynamic sampling (Yu et al. 2025, "DAPO", sec. 3.2): a group whose rewards are all equal has no
    GRPO signal, so it is dropped and more tasks are rolled out, until the step has `trainer.tasks_per_step`
    groups with signal or `max_oversample` extra tasks were tried (see ajet/algorithm/sampling.py)."""

    enabled: bool = Field(False, description="turn dynamic sampling on: drop each group whose rewards are all equal "
                                             "and roll out more tasks in its place")
    max_oversample: int = Field(8, ge=0, description="extra tasks a step may roll out to replace zero-std groups")
    success_reward: float | None = Field(
        None, allow_inf_nan=False,
        description="also drop (and replace) each group in which no episode's reward reached this: its reward "
                    "differences are partial credit only (a format or tool bonus), which alone can pay a behaviour "
                    "that never solves the task. The lower bound of PRIME's online prompt filter (Cui et al. 2025) "
                    "at one success; see ajet/algorithm/sampling.py. None: keep them")


class GuardsConfig(_Section):
    """What the update refuses before it trains (see ajet/algorithm/guards.py); each is counted per step
    (guards/* in metrics.jsonl) and the episode's `not_trained` reason names it."""

    stale_policy: Literal["drop", "flag"] = Field(
        "drop", description="a sample with a token served by a policy version more than trainer.async max_staleness "
                            "behind: drop it (async/stale_samples), or train it importance-corrected and only count "
                            "its episode (guards/stale_policy_episodes)")


class DistillConfig(_Section):
    """On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD); the
    sampled-token reverse-KL form of Thinking Machines' "On-Policy Distillation", 2025): the student samples,
    the teacher scores the student's tokens, and the per-token reverse KL log pi_student - log pi_teacher
    joins the loss (`add`) or is the whole loss (`replace`). See `ajet.algorithm.loss.distill_loss`.

    teacher: a local Hugging Face model folder with the student's vocabulary (scored under the rollout's
    temperature and top_p), or the base URL of an OpenAI-compatible server that returns prompt logprobs, e.g.
    `http://10.0.0.2:8000/v1` for `vllm serve TEACHER` (`ajet.backbones.debug.remote_teacher.RemoteTeacher`:
    temperature 1). Debug backbone only."""

    teacher: str = Field(description="a local Hugging Face model folder with the student's vocabulary, or the base "
                                     "URL of an OpenAI-compatible server that returns prompt logprobs (e.g. "
                                     "`http://10.0.0.2:8000/v1` for vLLM)")
    teacher_model: str | None = Field(None, description="the served model name of a URL teacher (default: the "
                                                        "first of its /models)")
    coef: float = Field(1.0, gt=0, description="weight of the per-token reverse KL (log pi_student - log pi_teacher) "
                                               "in the loss")
    mode: Literal["add", "replace"] = Field(
        "add", description="add: the reverse KL joins the PPO loss; replace: it is the whole loss")


class AlgorithmConfig(_Section):
    """GRPO-family update with a PPO-clip token loss (Shao et al. 2024, DeepSeekMath; Schulman et al. 2017)."""

    name: Literal["grpo"] = Field("grpo", description="the update family: a GRPO-family update with a PPO-clip token "
                                                      "loss (the advantage is chosen by adv_estimator)")
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = Field(
        "grpo", description="verl's names and definitions (ajet/algorithm/advantage.py)")
    episode_weight: Literal["episode", "sample"] = Field(
        "episode", description="the 'seq' of the seq-mean-* loss modes: the episode (a forked episode counts once) or "
                               "each sample (verl's per-row semantics)")
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="DAPO's dynamic sampling: replace groups whose rewards are"
                                                           " all equal")
    guards: GuardsConfig = Field(
        default_factory=GuardsConfig, description="what the update refuses to train before it trains")
    distill: DistillConfig | None = Field(None, description="on-policy distillation from a teacher (the keys below); "
                                                            "None: off. Debug backbone only")
    lr: float = Field(1e-6, gt=0, description="learning rate of the AdamW optimizer")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: the probability ratio is clipped below at 1 - "
                                                         "clip_ratio_low")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip: the probability ratio is clipped above at 1 + "
                                                          "clip_ratio_high (larger than clip_ratio_low: DAPO's "
                                                          "clip-higher)")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the initial policy; 0 disables the reference model")
    adv_eps: float = Field(1e-6, gt=0, description="added to the group's reward std before dividing (grpo), so that "
                                                   "advantages stay finite")
    norm_adv_by_std: bool = Field(True, description="divide advantages by the group std; False is one half of Dr. "
                                                     "GRPO (the other: loss_agg_mode seq-mean-token-sum-norm)")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "seq-mean-token-mean", description="verl's names; a 'seq' is an episode (see docs/algorithm.md)")
    loss_scale_factor: float | None = Field(
        None, gt=0, description="the constant C of seq-mean-token-sum-norm (Dr. GRPO), in tokens; None: the "
                                "longest response in the mini-batch")
    clip_ratio_c: float | None = Field(3.0, gt=1, description="dual-clip bound for negative advantages (verl); None disables")
    train_greedy_calls: bool = Field(False, description="train tokens of calls decoded greedily (temperature 0) as if "
                                                        "sampled at temperature 1; False records them with loss mask 0")
    group_by_agent_tag: bool = Field(False, description="multi-agent: the samples of each agent tag form their own "
                                                        "GRPO groups (False: one group per task)")
    trainable_targets: list[str] | None = Field(
        None, min_length=1, description="agent tags whose calls are trained on (None: every agent); the other "
                                        "agents still call the policy and are recorded, but never trained")
    ppo_epochs: int = Field(1, ge=1, description="passes over the step's samples in one update")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per ppo epoch")
    micro_batch_tokens: int = Field(4096, gt=0, description="tokens per forward/backward chunk")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping: the gradient's global L2 norm is scaled "
                                                        "down to at most this")
