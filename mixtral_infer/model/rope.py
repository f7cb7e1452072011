"""Rotary position embeddings in the published Mistral convention.

Each head's ``head_dim`` features are taken as ``head_dim / 2`` adjacent pairs
``(x[2j], x[2j+1])``, each rotated as a complex number by the angle
``position * theta ** (-2j / head_dim)``. (Hugging Face rotates the two halves
of the head instead; its q/k weight rows are permuted accordingly.)

Angles are computed for the positions of the current chunk only, so there is no
precomputed table and no maximum length.
"""

import torch


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles: two ``(T, 1, head_dim / 2)`` float32 tensors."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # (Dh/2,)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (T, Dh/2)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, H, D)`` by the angles; computed in float32, returned in x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (T, H, Dh/2, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
