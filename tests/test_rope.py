"""The native RMS norm and RoPE ops (`sparkspec.ops.rope`) against naive formulas: the oracles of the kernels."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from sparkspec.ops.rope import rms_norm, rope


def _rotation(positions: torch.Tensor, half: int) -> torch.Tensor:
    freqs = positions.float().unsqueeze(-1) * (10000.0 ** (-torch.arange(half, device=DEVICE) / half))
    return torch.polar(torch.ones_like(freqs), freqs)  # [T, R/2]


def _naive_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Pairs (2i, 2i+1) of the last R dims rotated by the angle of rot[:, i], with cos / sin."""
    R = 2 * rot.shape[1]
    out = x.clone()
    cos = rot.real.view([rot.shape[0]] + [1] * (x.dim() - 2) + [-1])
    sin = rot.imag.view_as(cos)
    even, odd = x[..., -R::2], x[..., -R + 1::2]
    out[..., -R::2] = even * cos - odd * sin
    out[..., -R + 1::2] = even * sin + odd * cos
    return out


@pytest.mark.parametrize("shape,half", [((6, 16), 4), ((6, 3, 8), 4), ((6, 2, 10), 5)])
def test_rope_rotates_the_last_pairs_and_passes_the_rest(shape, half):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).to(DEVICE)
    rot = _rotation(torch.arange(shape[0], device=DEVICE) * 7, half)
    torch.testing.assert_close(rope(x, rot), _naive_rope(x, rot))


def test_inverse_undoes_the_rotation():
    x = torch.randn(5, 4, 12, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rot = _rotation(torch.tensor([0, 3, 99, 1000, 5], device=DEVICE), 3)
    torch.testing.assert_close(rope(rope(x, rot), rot, inverse=True), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weighted", [True, False])
def test_norm_then_rope_is_one_rounding_of_both(weighted):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(4, 3, 16, generator=gen) * 5).to(DEVICE, torch.bfloat16)
    w = torch.randn(16, generator=gen).to(DEVICE) if weighted else None
    rot = _rotation(torch.arange(4, device=DEVICE), 4)
    got = rope(x, rot, norm_weight=w, norm_eps=1e-6)
    assert got.dtype == torch.bfloat16
    want = _naive_rope(rms_norm(x, w, 1e-6, torch.float32), rot).to(torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rms_norm_is_fp32_and_rounds_to_the_asked_dtype():
    x = torch.tensor([[3.0, 4.0]], device=DEVICE, dtype=torch.bfloat16)
    got = rms_norm(x, torch.tensor([1.0, 2.0], device=DEVICE), 0.0, torch.float32)
    torch.testing.assert_close(got, torch.tensor([[3.0, 8.0]], device=DEVICE) / (12.5 ** 0.5))
    assert rms_norm(x, None, 1e-6).dtype == torch.bfloat16
