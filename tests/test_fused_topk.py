"""The indexer's top-k select (`triton_kernels.compressor._topk_select_kernel`): one bitonic sort per row in
place of torch's radix sort, the same ids as the native's stable descending sort. Under TRITON_INTERPRET=1 on a
CPU (SPARKSPEC_TEST_DEVICE=cuda: compiled)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, triton_kernels

(tri_comp,) = triton_kernels("compressor")


def _native_select(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """What `ops.compressor.indexer_topk` does with its scores."""
    k = min(topk, scores.shape[1])
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    ids = torch.where(values[:, :k] > float("-inf"), order[:, :k], -1)
    return torch.nn.functional.pad(ids, (0, topk - k), value=-1)


def _select(scores: torch.Tensor, topk: int) -> torch.Tensor:
    T, C = scores.shape
    out = torch.full((T, topk), 7, dtype=torch.long, device=scores.device)  # every slot must be written
    block = max(triton_next_pow2(C), 16)
    tri_comp._topk_select_kernel[(T,)](scores.contiguous(), out, out, out, out, C, min(topk, C), topk, 0, 0, 0, 0,
                                       BLOCK_C=block, LISTS=False)
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@pytest.mark.parametrize("T,C,topk", [(4, 130, 128), (3, 37, 8), (2, 10, 16), (1, 1000, 64), (2, 64, 64)])
def test_select_is_the_stable_descending_sort(T, C, topk):
    g = torch.Generator().manual_seed(C)
    s = torch.randn(T, C, generator=g)
    s[:, ::7] = 0.0  # ties: all-zero ReLU scores, of both signs (0 · a negative weight is -0)
    s[:, 3::7] = -0.0
    s[0, 5:9] = 1.5  # a tie among positive scores
    s[-1, C // 2 :] = float("-inf")  # invisible entries: -1
    s[:, 1] = -1e-30  # tiny negatives, and extremes
    s[0, 2 % C] = 3e38
    s = s.to(DEVICE)
    assert torch.equal(_select(s, topk), _native_select(s, topk))


def test_select_rows_with_nothing_visible():
    s = torch.full((2, 50), float("-inf"), device=DEVICE)
    s[1, 7] = -2.0
    got = _select(s, 8)
    assert (got[0] == -1).all()
    assert got[1, 0] == 7 and (got[1, 1:] == -1).all()


def test_indexer_topk_over_the_select_limit_takes_the_sort(monkeypatch):
    monkeypatch.setattr(tri_comp, "TOPK_SELECT_MAX_ENTRIES", 16)
    from sparkspec.ops import compressor

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(2, 4, generator=g).to(DEVICE)
    keys = torch.randn(1, 40, 16, generator=g).to(DEVICE)
    req = torch.zeros(2, dtype=torch.long, device=DEVICE)
    vis = torch.tensor([40, 11], device=DEVICE)
    assert torch.equal(tri_comp.indexer_topk(q, w, keys, req, vis, 8, 0.5),
                       compressor.indexer_topk(q, w, keys, req, vis, 8, 0.5))


def test_indexer_topk_weight_scale_is_the_scaled_weights():
    """weight_scale c on bf16 head weights gives what the fp32 weights · c gave (the model's old cast and mul)."""
    from sparkspec.ops import compressor

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 8, 32, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(3, 8, generator=g).to(DEVICE, torch.bfloat16)
    keys = torch.randn(2, 50, 32, generator=g).to(DEVICE)
    req = torch.tensor([0, 1, 1], device=DEVICE)
    vis = torch.tensor([50, 20, 3], device=DEVICE)
    c = 8 ** -0.5
    for impl in (tri_comp.indexer_topk, compressor.indexer_topk):
        assert torch.equal(impl(q, w, keys, req, vis, 16, 0.2, c), impl(q, w.float() * c, keys, req, vis, 16, 0.2))
