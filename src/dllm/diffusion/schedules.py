"""Noise schedules alpha(t): the probability that a token is still clean at time t in [0, 1].

For masked diffusion the continuous-time ELBO weights the cross-entropy of each masked token by
w(t) = -alpha'(t) / (1 - alpha(t))  (MDLM, Sahoo et al. 2024, eq. 10; Shi et al. 2024).
"""

from __future__ import annotations

import math

import torch


class LinearSchedule:
    """alpha(t) = 1 - t, so w(t) = 1 / t (LLaDA's loss)."""

    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        return 1.0 - t

    def weight(self, t: torch.Tensor) -> torch.Tensor:
        return 1.0 / t


class CosineSchedule:
    """alpha(t) = 1 - cos(pi/2 (1 - t)), so w(t) = pi/2 * tan(pi/2 (1 - t))."""

    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        return 1.0 - torch.cos(0.5 * math.pi * (1.0 - t))

    def weight(self, t: torch.Tensor) -> torch.Tensor:
        return 0.5 * math.pi * torch.tan(0.5 * math.pi * (1.0 - t))
