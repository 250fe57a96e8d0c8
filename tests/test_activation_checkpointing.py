"""`model.gradient_checkpointing`: the debug backbone's update keeps only each decoder layer's input and recomputes
the layer in the backward pass. The same update (several micro-batches, clipped tokens, a KL term) must move the
weights bit for bit as without it, while the training forward saves a fraction of the activations."""

import pytest
import torch

from ajet.backbones.debug.backbone import DebugBackbone, _collate, token_logprobs
from ajet.config import AjetConfig
from tests.test_update_where_trained import _episodes


def _backbone(model_dir, checkpointing: bool, **algorithm):
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"},
                     model={"path": model_dir, "device": "cpu", "gradient_checkpointing": checkpointing},
                     algorithm={"micro_batch_tokens": 96, **algorithm})
    return DebugBackbone(cfg)


def _saved_bytes(bb, samples) -> int:
    """Bytes of the tensors autograd keeps for the backward of one training forward over `samples`."""
    batch = _collate(samples, [1.0] * len(samples), bb.tokenizer.pad_token_id, bb.device)
    total = 0

    def pack(t):
        nonlocal total
        total += t.nelement() * t.element_size()
        return t

    bb.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(bb.model, batch["input_ids"], batch["attention_mask"], batch["temperatures"], batch["top_ps"],
                       score_mask=batch["loss_mask"])
    bb.model.eval()
    return total


@pytest.mark.parametrize("algorithm", [{}, {"kl_coef": 0.1, "ppo_epochs": 2, "mini_batches": 2}],
                         ids=["one-step", "kl+2-epochs+2-mini-batches"])
def test_checkpointed_update_moves_the_weights_bit_for_bit_as_without(tiny_model_dir, algorithm):
    plain, ckpt = _backbone(tiny_model_dir, False, **algorithm), _backbone(tiny_model_dir, True, **algorithm)
    try:
        nucleus = "kl_coef" not in algorithm
        a, b = _episodes(plain, nucleus=nucleus), _episodes(ckpt, nucleus=nucleus)
        before = [p.detach().clone() for p in plain.model.parameters()]
        stats_plain, stats_ckpt = plain.update(a), ckpt.update(b)
        moved = any(not torch.equal(p, q) for p, q in zip(before, plain.model.parameters()))
        same = [torch.equal(p, q) for p, q in zip(plain.model.parameters(), ckpt.model.parameters())]
    finally:
        plain.close()
        ckpt.close()
    assert moved and stats_plain["optimizer_steps"] >= 1
    assert all(same), f"{same.count(False)} of {len(same)} parameters differ"
    stats_plain.pop("update_s"), stats_ckpt.pop("update_s")
    assert stats_ckpt == stats_plain


def test_checkpointed_forward_keeps_only_a_fraction_of_the_activations(tiny_model_dir):
    plain, ckpt = _backbone(tiny_model_dir, False), _backbone(tiny_model_dir, True)
    try:
        samples = _episodes(plain)
        kept_plain, kept_ckpt = _saved_bytes(plain, samples), _saved_bytes(ckpt, samples)
    finally:
        plain.close()
        ckpt.close()
    assert 0 < kept_ckpt < kept_plain / 2, (kept_ckpt, kept_plain)
