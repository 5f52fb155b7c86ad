"""The Edit Flows coupling schedule kappa(t), shared by the edit_flow objective and the tau-leaping sampler.

kappa(t) is the chance that an aligned column already shows its x_1 side at time t (kappa(0) = 0,
kappa(1) = 1). The true edit rate factors as u_t(x) = w(t) * lambda(x) with the scheduler weight
w(t) = kappa'(t) / (1 - kappa(t)); its integral is K(t) = -log(1 - kappa(t)) (K(0) = 0, K(1) = inf),
so a time-free intensity lambda fires over [t, s] with probability 1 - exp(-(K(s) - K(t)) lambda).
"""

from __future__ import annotations

import math

import torch

KAPPAS = ("cubic", "linear")
"""The schedules: cubic kappa = t^3, linear kappa = t."""


def kappa_and_weight(name: str, t_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kappa(t) and w(t) = kappa'(t) / (1 - kappa(t)) of the cubic (t^3) or linear (t) schedule."""
    if name == "cubic":
        return t_B**3, 3.0 * t_B**2 / (1.0 - t_B**3)
    return t_B, 1.0 / (1.0 - t_B)


def cumulative_weight(name: str, t: float) -> float:
    """K(t) = -log(1 - kappa(t)), the integral of w from 0 to t (inf at t = 1)."""
    kappa = t**3 if name == "cubic" else t
    return math.inf if kappa >= 1.0 else -math.log1p(-kappa)


def time_of_weight(name: str, K_B: torch.Tensor) -> torch.Tensor:
    """The t with K(t) = K_B (the inverse of `cumulative_weight`): kappa = 1 - exp(-K), t = kappa^(1/3) or kappa."""
    kappa_B = -torch.expm1(-K_B)
    return kappa_B.pow(1.0 / 3.0) if name == "cubic" else kappa_B
