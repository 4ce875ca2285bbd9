"""Gaussian noise, drawn once per logical batch.

Every rank derives the same generator from (seed, step) and adds the same noise *after* the
clipped sums are all-reduced, so the model sees noise of variance σ²C² whatever the world size.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

_NOISE_STREAM = 1
_LOGGING_STREAM = 2


def fresh_seed() -> int:
    """A seed from OS entropy: the default, so nobody can reconstruct (and subtract) the noise."""
    return secrets.randbits(63)


def add_noise(params, *, noise_multiplier: float, max_grad_norm: float, seed: int, step: int) -> None:
    """Add N(0, (σ·C)²) to every `p.grad` (drawn in float32 on the parameter's device)."""
    std = noise_multiplier * max_grad_norm
    base = int(np.random.SeedSequence([seed, step, _NOISE_STREAM]).generate_state(1, dtype=np.uint64)[0] >> 1)
    generators: dict = {}
    for param in params:
        device = param.grad.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(base)
        noise = torch.normal(0.0, std, size=param.shape, generator=generators[device], device=device)
        param.grad.add_(noise.to(param.grad.dtype))


def add_scalar_noise(values, stds, *, seed: int, step: int) -> list[float]:
    """Each of `values` plus N(0, std²), drawn in float64 from (seed, step): the same on every rank.

    Used for the logged sums (loss, clipped units), on a stream of their own: the gradient noise is unchanged.
    """
    state = np.random.SeedSequence([seed, step, _LOGGING_STREAM])
    rng = np.random.default_rng(state)
    return [float(value) + float(rng.normal(0.0, std)) for value, std in zip(values, stds)]
