"""What AdamW's first update makes of a gradient difference, for the backbone conformance bounds on the weights.

Imported by the test (core env) and by verl_update_check.py inside the verl venv (as a sibling module), so it
needs torch only.
"""

from __future__ import annotations

import torch


def adam_first_update(grads: dict[str, torch.Tensor], lr: float, eps: float,
                      max_grad_norm: float) -> dict[str, torch.Tensor]:
    """AdamW's first update (weight decay left out) from `grads` `{name: tensor}`, float64.

    The gradient is first clipped as `torch.nn.utils.clip_grad_norm_` does (scaled by
    `min(1, max_grad_norm / (||g|| + 1e-6))`, `||g||` over all tensors); at step 1 the bias-corrected moments are
    m_hat = g and v_hat = g^2, so each coordinate moves by `-lr * g / (|g| + eps)` (Kingma & Ba 2015, Algorithm 1;
    Loshchilov & Hutter 2019 for the decoupled decay, which is the same on both sides of a comparison).
    """
    norm = sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5
    clip = min(1.0, max_grad_norm / (norm + 1e-6))
    return {k: -lr * (clip * g.double()) / ((clip * g.double()).abs() + eps) for k, g in grads.items()}


def first_update_rel(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], lr: float, eps: float,
                     max_grad_norm: float) -> float:
    """||A(grads) - A(reference)|| / ||A(reference)|| (L2 over all tensors) for A = `adam_first_update`: how far
    apart two backbones' weights are after their first update, given only their gradients.

    Adam moves every coordinate by about `lr` whatever its gradient's size, so a coordinate whose gradient is
    near zero (|g| within a few `eps`, or within the two sides' float32 difference of 0) counts as much in the
    weights as a large one, and there the relative gradient difference is large: the weights part by many
    times the gradients' relative L2 (which the large coordinates dominate). Per coordinate
    |dA/dg| = lr * eps / (|g| + eps)^2 <= lr / eps.
    """
    a, b = (adam_first_update(g, lr, eps, max_grad_norm) for g in (grads, reference))
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / den) ** 0.5
