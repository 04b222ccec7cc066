"""The FP8 block-scaled linear's Triton kernel (TRITON_INTERPRET=1 on a CPU) against dequantise-then-matmul, at
decode-sized and larger row counts, over its tile shapes: split over K (whole scale blocks per program plus the
reduction launch), the swapped W·xᵀ orientation, scales that are not powers of two.

Legend: M rows of x, N out features, K in features (neither a multiple of 128 unless named).
Tolerances: bf16 1 ulp of the fp32 oracle (`test_triton_kernels.assert_close`); fp32 1e-5 of Σ|x·w| per output
(the summation order differs: split K, per-block partial sums; cancelling outputs get no relative bound).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DEVICE

if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton in this process

from helpers import quantize_fp8_block
from test_triton_kernels import assert_close as assert_close_bf16

from sparkspec.ops.formats import dequant_fp8_block
from sparkspec.ops.quant import fp8_block_linear

tq = pytest.importorskip("sparkspec.ops.triton_kernels.quant")
GemmConfig = tq.GemmConfig


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_weight(N: int, K: int, seed: int, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] e4m3 codes with a scale per 128x128 block, varied per block (rows scaled 0..3 before
    quantising); `pow2=False` multiplies each scale by a random factor in [1, 2) (not a power of two)."""
    w = torch.randn(N, K, generator=_gen(seed)) * torch.rand(N, 1, generator=_gen(seed + 1)) * 3
    q, s = quantize_fp8_block(w)
    if not pow2:
        s = s * (1 + torch.rand(s.shape, generator=_gen(seed + 2)))
    return q.to(DEVICE), s.to(DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> None:
    if got.dtype != torch.float32:
        return assert_close_bf16(got, want)
    bound = 1e-5 * (x.float().abs() @ dequant_fp8_block(w, s).abs().t()) + 1e-6  # [M, N]
    worst = ((got - want).abs() / bound).max().item()
    assert worst <= 1.0, f"fp32 error {worst:.2f} x its bound"


def run(M: int, N: int, K: int, dtype: torch.dtype, config: GemmConfig | None, pow2: bool = True, seed: int = 0):
    w, s = fp8_weight(N, K, seed=seed + N, pow2=pow2)
    x = torch.randn(M, K, generator=_gen(seed + K)).to(DEVICE, dtype)
    got = tq.fp8_block_linear_triton(x, w, s, config)
    assert got.dtype == dtype and got.shape == (M, N)
    assert_close(got, fp8_block_linear(x.float(), w, s), x, w, s)


SHAPES = [(1, 200, 300), (5, 130, 260), (64, 72, 392)]  # (M, N, K): ragged last blocks in N and K
CONFIGS = {
    "auto": None,
    "no-split": GemmConfig(16, 16, 32, 4, 1, split_k=1),
    "split3": GemmConfig(16, 32, 64, 4, 1, split_k=3),
    "swap-split2": GemmConfig(16, 16, 128, 4, 1, split_k=2, swap=True),
    "tall": GemmConfig(32, 16, 32, 4, 1, split_k=1, swap=True),
}


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_linear_matches_dequantise_then_matmul(M, N, K, config, dtype):
    run(M, N, K, dtype, CONFIGS[config])


@pytest.mark.parametrize("config", ["auto", "swap-split2"])
def test_fp8_linear_with_scales_that_are_not_powers_of_two(config):
    """The scale multiplies each block's partial sum instead of every weight: one more fp32 rounding, no more."""
    run(5, 130, 260, torch.float32, CONFIGS[config], pow2=False)


def test_fp8_linear_block_scales_reach_their_blocks():
    """Scaling one 128x128 block changes only the outputs of its 128 rows of W (a misplaced scale index, e.g.
    transposed or per split instead of per block, fails here); the kernel follows the oracle."""
    N, K = 260, 300
    w, s = fp8_weight(N, K, seed=7)
    x = torch.randn(3, K, generator=_gen(8)).to(DEVICE)
    cfg = GemmConfig(16, 16, 32, 4, 1, split_k=2)
    base = tq.fp8_block_linear_triton(x, w, s, cfg)
    s2 = s.clone()
    s2[1, 2] *= 4  # rows 128..255, columns 256..299 (the ragged last K block)
    moved = tq.fp8_block_linear_triton(x, w, s2, cfg)
    changed = (moved - base).abs().amax(0) > 1e-4  # [N]
    assert changed[128:256].all() and not changed[:128].any() and not changed[256:].any()
    assert_close(moved, fp8_block_linear(x, w, s2), x, w, s2)


def test_fp8_linear_splits_cover_every_scale_block_once():
    """num_splits: no empty split, every 128-column block in exactly one split, the cap at the block count."""
    cfg = GemmConfig(16, 64, 128, split_k=5)
    for K in (100, 128, 300, 1024, 4096):
        num_kb = -(-K // 128)
        split, per = tq.num_splits(cfg, 1, 1024, K, torch.device("cpu"))
        assert 1 <= split <= min(5, num_kb) and (split - 1) * per < num_kb <= split * per
    auto = tq.num_splits(GemmConfig(16, 64, 128), 1, 1024, 4096, torch.device("cpu"))
    assert auto == (16, 2)  # 16 tiles x 16 splits = 2 programs on each of 132 SMs; 32 blocks, 2 each
    assert tq.num_splits(GemmConfig(64, 128, 64), 4096, 4096, 4096, torch.device("cpu"))[0] == 1


def test_fp8_linear_keeps_leading_dims_and_strided_rows():
    w, s = fp8_weight(130, 260, seed=3)
    x = torch.randn(2, 3, 520, generator=_gen(4)).to(DEVICE)[..., ::2]  # last-dim stride 2: copied once
    got = tq.fp8_block_linear_triton(x, w, s)
    assert got.shape == (2, 3, 130)
    assert_close(got, fp8_block_linear(x, w, s), x, w, s)
    rows = torch.randn(6, 400, generator=_gen(5)).to(DEVICE)[:, 50:310]  # row stride 400, read in place
    assert_close(tq.fp8_block_linear_triton(rows, w, s), fp8_block_linear(rows, w, s), rows, w, s)


def test_fp8_linear_wrapper_refuses_bad_inputs():
    w, s = fp8_weight(130, 260, seed=0)
    x = torch.zeros(1, 260, device=DEVICE)
    with pytest.raises(ValueError, match="block_k"):
        tq.fp8_block_linear_triton(x, w, s, GemmConfig(16, 16, 48))
    with pytest.raises(ValueError, match=">= 16"):
        tq.fp8_block_linear_triton(x, w, s, GemmConfig(8, 16, 32))
    with pytest.raises(ValueError, match="bf16 / fp16 / fp32"):
        tq.fp8_block_linear_triton(x.double(), w, s)
    assert tq.fp8_block_linear_triton(torch.zeros(0, 260, device=DEVICE), w, s).shape == (0, 130)
