"""Per-step addressing pieces (`ops.indices`): pool rows against a loop over block tables, and the CSA index
lists the model builds from per-step pieces against `paged_attention_indices`."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from sparkspec.ops.indices import (
    _paged_attention_indices_native,
    chosen_rows,
    entry_table,
    pool_rows,
    sliding_rows,
)

TABLES = torch.tensor([[3, 0, 5, 6], [1, 4, 2, 7]], device=DEVICE)  # two requests, blocks interleaved


def _naive_row(tables, r, p, block_size, rows_per_block, first_row, ratio) -> int:
    if p < 0:
        return -1
    q = p * ratio
    return int(tables[r, q // block_size]) * rows_per_block + first_row + (q % block_size) // ratio


@pytest.mark.parametrize("block_size,ratio,first_row", [(8, 1, 0), (8, 4, 8), (8, 8, 8), (4, 8, 4), (8, 4, 0)])
def test_pool_rows_match_the_block_table_walk(block_size, ratio, first_row):
    rows_per_block = block_size + 3
    positions = torch.tensor([[-3, 0, 1, 5], [7, 2, -1, 3]], device=DEVICE)
    positions = positions.clamp(max=TABLES.shape[1] * block_size // ratio - 1)
    req = torch.tensor([[0], [1]], device=DEVICE).expand_as(positions)
    got = pool_rows(TABLES, req, positions, block_size, rows_per_block, first_row, ratio)
    want = [[_naive_row(TABLES, int(r), int(p), block_size, rows_per_block, first_row, ratio)
             for r, p in zip(rr, pp)] for rr, pp in zip(req, positions)]
    assert got.tolist() == want


@pytest.mark.parametrize("block_size,ratio", [(8, 4), (4, 8)])
def test_chosen_rows_equal_paged_attention_indices(block_size, ratio):
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([4, 5, 17, 22, 23, 30], device=DEVICE)
    req = torch.tensor([0, 0, 1, 1, 1, 0], device=DEVICE)
    tables = torch.cat([TABLES, TABLES + 8], dim=1)  # 32 positions at block size 4
    C = tables.shape[1] * block_size // ratio
    topk = torch.randint(-1, C, (6, 5), generator=gen).to(DEVICE)
    window = 6
    e = -(-block_size // ratio)
    got = chosen_rows(sliding_rows(positions, req, tables, block_size, window, block_size + e),
                      entry_table(tables, block_size, ratio, C), req, topk)
    want = _paged_attention_indices_native(positions, req, tables, block_size, window, ratio, topk, C)
    assert torch.equal(got, want)


@pytest.mark.parametrize("block_size,ratio", [(8, 4), (4, 8), (8, 128)])
def test_batch_pieces_equal_paged_attention_indices(block_size, ratio):
    """The model's lists from the batch's memoised pieces (window rows shared by every ratio, the visible entries of
    a heavily compressed layer, the CSA choice) = `paged_attention_indices` of the same step."""
    from types import SimpleNamespace

    from sparkspec.models.forward_batch import ForwardBatch

    tables = torch.cat([TABLES, TABLES + 8], dim=1)
    positions = torch.tensor([4, 5, 17, 22, 23, 30], device=DEVICE)
    req = torch.tensor([0, 0, 1, 1, 1, 0], device=DEVICE)
    max_seq_len = tables.shape[1] * block_size
    batch = ForwardBatch(positions, positions, req, torch.tensor([0, 6], device=DEVICE), torch.tensor([31, 24]),
                         tables, None, {}, SimpleNamespace(block_size=block_size), max_seq_len)
    window, C = 6, max_seq_len // ratio
    sliding = _paged_attention_indices_native(positions, req, tables, block_size, window, 1, None, 0)
    assert torch.equal(batch.sliding_rows(window, 1), sliding)
    hca = torch.cat([batch.sliding_rows(window, ratio), batch.visible_entry_rows(ratio)], dim=1)
    assert torch.equal(hca, _paged_attention_indices_native(positions, req, tables, block_size, window, ratio, None,
                                                            C))
    topk = torch.randint(-1, C, (6, 5), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    csa = chosen_rows(batch.sliding_rows(window, ratio), batch.entry_table(ratio), req, topk)
    assert torch.equal(csa, _paged_attention_indices_native(positions, req, tables, block_size, window, ratio, topk,
                                                            C))
