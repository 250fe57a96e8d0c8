"""Trinity's policy loss over several micro-batches: each micro-batch's loss scaled to its share of the step.

Trinity-RFT 0.6's `TrinityPolicyLoss` (trinity/trainer/verl/losses.py) aggregates the loss of ONE micro-batch
(`trinity.algorithm.utils.aggregate_loss`: a token-mean over the micro-batch's loss tokens, or a seq-mean over
its rows), and verl 0.8's FSDP engine (verl/workers/engine/fsdp/transformer_impl.py `forward_backward_batch`)
calls `backward()` on each micro-batch's loss, so the gradients of k micro-batches add up to k means, not one:
the update would depend on how verl packed the rows. verl's own losses avoid this by dividing by the whole
step's counts, which the engine writes into every micro-batch (`batch_num_tokens`: the loss tokens of the
global batch, all data-parallel ranks; `global_batch_size`: its rows; `dp_size`: FSDP averages the ranks'
gradients, so each rank's loss is multiplied back by it; verl/trainer/ppo/core_algos.py `agg_loss`).

`MicroBatchShareLoss` multiplies Trinity's micro-batch loss by the micro-batch's share of those counts:

    token-mean:           loss_mb * tokens_mb * dp_size / batch_num_tokens
    seq-mean-token-mean,
    seq-mean-token-sum:   loss_mb * rows_mb   * dp_size / global_batch_size

so that the sum over micro-batches (and the average over ranks) is the whole step's mean, as in one micro-batch.
With one micro-batch on one rank the factor is exactly 1. `seq-mean-token-sum-norm` divides by the micro-batch's
padded width, which no share undoes: the backbone keeps that mode to one micro-batch per step
(`backbones/trinity/config.py`). The KL and entropy terms use the same `loss_agg_mode`, so the whole returned
loss takes the one factor.

The loss object is built inside each Ray worker (`set_trinity_config` -> `build_trinity_loss`), so
`setup_worker`, Ray's `worker_process_setup_hook` for the backbone's cluster, replaces that builder there.
"""

from __future__ import annotations

SHARED_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def micro_batch_share(data, loss_agg_mode: str) -> float:
    """The factor that turns a micro-batch's mean loss into its share of the step's mean.

    Args:
        data: verl's micro-batch `TensorDict` (rows x jagged tokens; `loss_mask` [rows, tokens]) with the
            engine's non-tensor `dp_size`, `batch_num_tokens` (tokens) and `global_batch_size` (rows).
        loss_agg_mode: one of `SHARED_MODES`.

    Raises:
        ValueError: a mode without a share (`seq-mean-token-sum-norm`), or a step with no loss token.
    """
    dp_size = int(data["dp_size"])
    if loss_agg_mode == "token-mean":
        total = float(data["batch_num_tokens"])
        if total <= 0:
            raise ValueError("the step has no loss token (batch_num_tokens is 0)")
        return float(data["loss_mask"].sum()) * dp_size / total
    if loss_agg_mode in SHARED_MODES:
        return data.batch_size[0] * dp_size / int(data["global_batch_size"])
    raise ValueError(f"loss_agg_mode {loss_agg_mode!r} has no micro-batch share; train it in one micro-batch")


class MicroBatchShareLoss:
    """Trinity's loss callable (verl's engine signature `(model_output, data, dp_group) -> (loss, metrics)`) with
    the loss scaled by `micro_batch_share`. Picklable: Ray may ship it.

    Args:
        inner: Trinity's `TrinityPolicyLoss` (its `loss_agg_mode` decides the share).
    """

    def __init__(self, inner):
        self.inner = inner
        self.loss_agg_mode = inner.loss_agg_mode

    def __call__(self, model_output: dict, data, dp_group=None):
        loss, metrics = self.inner(model_output, data, dp_group)
        if self.loss_agg_mode not in SHARED_MODES:     # seq-mean-token-sum-norm: one micro-batch per step
            return loss, metrics
        share = micro_batch_share(data, self.loss_agg_mode)
        metrics["micro_batch_share"] = share
        return loss * share, metrics

    def __repr__(self) -> str:
        return f"MicroBatchShareLoss({self.inner!r})"


def _build_trinity_loss_shared(algo_config) -> MicroBatchShareLoss:
    from trinity.trainer.verl.losses import build_trinity_loss

    return MicroBatchShareLoss(build_trinity_loss(algo_config))


def use_micro_batch_loss(workers) -> None:
    """Make Trinity's worker module `workers` (`trinity.trainer.verl.workers`) build `MicroBatchShareLoss` around its
    policy loss (idempotent)."""
    workers.build_trinity_loss = _build_trinity_loss_shared


def _patch_verl(_verl) -> None:
    from ajet.backbones.trinity.cpu import patch_verl_for_cpu     # imported here: this module imports nothing

    patch_verl_for_cpu()


_WORKER_PATCHES = {     # module -> its change, made once a worker imports it (`setup_worker`)
    "verl": _patch_verl,                                            # the CPU changes (a no-op with CUDA)
    "trinity.trainer.verl.workers": use_micro_batch_loss,
}


def setup_worker() -> None:
    """Ray's `worker_process_setup_hook` for the trinity backbone's cluster: the CPU changes of
    `backbones/trinity/cpu.py` once the worker imports verl, and `use_micro_batch_loss` once it imports Trinity's
    worker module (`ajet.backbones.import_patch`); a module imported before the hook ran is changed at once. A worker
    that imports neither (ajet's explorer handle, Ray's idle workers) no longer imports verl for them: the hook costs
    0.08 s of CPU instead of 8.2 s on the 2-core machine. Raises ImportError (when the module is imported) if the
    installed verl or Trinity lacks what the changes touch."""
    import sys

    from ajet.backbones.import_patch import patch_on_import

    for name, patch in _WORKER_PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    patch_on_import(_WORKER_PATCHES)
