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


def adamw_first_step(weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float, eps: float,
                     weight_decay: float, max_grad_norm: float,
                     betas: tuple[float, float] = (0.9, 0.999)) -> dict[str, torch.Tensor]:
    """The weights `{name: w1}` (float32, as trained) after torch's own AdamW's first step from `weights` with
    the gradients `grads` (both `{name: tensor}`, same names and shapes), clipped first by
    `torch.nn.utils.clip_grad_norm_(..., max_grad_norm)`: a backbone whose first update runs this float32
    arithmetic on these gradients lands on exactly these weights (measured: verl's FSDP2 AdamW and the debug
    backbone's, every mode, bit for bit).

    Unlike `adam_first_update` (float64, the weights left out) it includes the rounding of w0 + update to
    float32, which is coarse where a weight is large: an RMSNorm gain starts at 1.0, where float32's spacing is
    1.2e-7 (6e-8 below 1), 0.4% of an update of lr = 3e-5, so two updates 1e-8 apart can land a whole spacing
    apart, about 1e-5 of the update's norm (~1e-2) from that one coordinate.
    """
    params = {k: torch.nn.Parameter(w.detach().clone().float()) for k, w in weights.items()}
    for k, p in params.items():
        p.grad = grads[k].detach().clone().float()
    torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)
    torch.optim.AdamW(list(params.values()), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay).step()
    return {k: p.detach() for k, p in params.items()}


def rounding_units(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                   initial: dict[str, torch.Tensor]) -> float:
    """How far `weights` are from `reference` (both `{name: float32 tensor}`, one update after `initial`) in
    float32 rounding units: the largest over all coordinates of |w - r| / (s(r) + s(r - w0)), s(x) being
    float32's spacing at |x| (the gap to the next float32 up), so that one rounding of the update and one of the
    weight make about 1 unit. 0 for the same arithmetic; a few for the same step computed another way (measured
    up to 4.4 for other betas, whose first step is mathematically the same, 2.7 for a gradient 1e-7 off); an
    update scaled by 1 + d is about d lr / s(w) units off at a weight w, which the weights nearest 0 make large
    (measured: lr 1e-5 off, 160 units; an update not applied, 1.6e7)."""
    worst = 0.0
    for k, r in reference.items():
        r = r.float()
        unit = _spacing(r) + _spacing(r - initial[k].float())
        worst = max(worst, float(((weights[k].double() - r.double()).abs() / unit).max()))
    return worst


def _spacing(x: torch.Tensor) -> torch.Tensor:
    """float32's spacing at |x| (the gap from |x| to the next float32 up), float64, elementwise."""
    x = x.float().abs()
    return (torch.nextafter(x, torch.tensor(float("inf"))) - x).double()
