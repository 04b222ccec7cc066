"""Per-step addressing in one launch (`triton_kernels.indices`: pool_rows, chosen_rows) against the natives in
`ops.indices` (the oracles): the same integers. Under TRITON_INTERPRET=1 on a CPU (SPARKSPEC_TEST_DEVICE=cuda:
compiled)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, triton_kernels

tri_comp, tri_idx = triton_kernels("compressor", "indices")

from sparkspec.ops import compressor  # noqa: E402
from sparkspec.ops.indices import _chosen_rows_native, _emission_plan_native, _pool_rows_native  # noqa: E402


def _tables(R: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(4 * width, generator=g)[:width] for _ in range(R)]).to(DEVICE)


@pytest.mark.parametrize("block_size,ratio,first_row,fill", [
    (8, 1, 0, -1), (8, 4, 8, 17), (8, 8, 8, -1), (4, 8, 4, 0), (8, 128, 8, 5), (16, 4, 0, -1)])
def test_pool_rows_equal_the_native(block_size, ratio, first_row, fill):
    """2-D positions of both signs against a broadcast request column, at every ratio case of the native."""
    R, width = 3, 6
    tables = _tables(R, width, seed=block_size + ratio)
    g = torch.Generator().manual_seed(ratio)
    limit = width * block_size // ratio
    pos = torch.randint(-5, limit, (R, 37), generator=g).to(DEVICE)
    req = torch.arange(R, device=DEVICE).unsqueeze(1)  # [R, 1]: stride-0 broadcast
    rpb = block_size + 3
    got = tri_idx.pool_rows(tables, req, pos, block_size, rpb, first_row, ratio, fill)
    want = _pool_rows_native(tables, req, pos, block_size, rpb, first_row, ratio, fill)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert (got[pos < 0] == fill).all() and (got[pos >= 0] >= first_row).all()


@pytest.mark.parametrize("shape", ["1d", "row", "expand"])
def test_pool_rows_shapes(shape):
    """1-D lists, a [1, C] row against [R, 1] requests (-> [R, C]) and an expanded request tensor."""
    tables = _tables(2, 4, seed=1)
    if shape == "1d":
        pos, req = torch.tensor([3, -1, 0, 31], device=DEVICE), torch.tensor([1, 0, 0, 1], device=DEVICE)
    elif shape == "row":
        pos, req = torch.arange(7, device=DEVICE).unsqueeze(0), torch.arange(2, device=DEVICE).unsqueeze(1)
    else:
        pos = torch.tensor([[5, -2, 9], [0, 1, 30]], device=DEVICE)
        req = torch.tensor([1, 0], device=DEVICE).unsqueeze(1).expand_as(pos)
    got = tri_idx.pool_rows(tables, req, pos, 8, 8)
    assert torch.equal(got, _pool_rows_native(tables, req, pos, 8, 8))


def test_pool_rows_fill_is_what_the_model_clamped_to():
    """fill=0 / fill=trash equal the clamp and the where the emission plan applied before (valid rows are >= 0)."""
    tables = _tables(2, 4, seed=2)
    pos = torch.tensor([[-3, 0, 7], [12, -1, 2]], device=DEVICE)
    req = torch.tensor([[0], [1]], device=DEVICE)
    plain = _pool_rows_native(tables, req, pos, 8, 8)
    assert torch.equal(tri_idx.pool_rows(tables, req, pos, 8, 8, fill=0), plain.clamp(min=0))
    assert torch.equal(tri_idx.pool_rows(tables, req, pos, 8, 8, fill=99), torch.where(plain >= 0, plain, 99))


@pytest.mark.parametrize("T,W,K,C", [(1, 128, 128, 140), (5, 8, 3, 4), (3, 6, 40, 1)])
def test_chosen_rows_equal_the_native(T, W, K, C):
    """Window rows then the chosen entries' table rows, -1 pads to the table's -1 column."""
    g = torch.Generator().manual_seed(T + K)
    R = 2
    window = torch.randint(-1, 1000, (T, W), generator=g).to(DEVICE)
    table = torch.cat([torch.randint(0, 1000, (R, C), generator=g), torch.full((R, 1), -1)], dim=1).to(DEVICE)
    req = torch.randint(0, R, (T,), generator=g).to(DEVICE)
    topk = torch.randint(-1, C, (T, K), generator=g).to(DEVICE)
    got = tri_idx.chosen_rows(window, table, req, topk)
    assert torch.equal(got, _chosen_rows_native(window, table, req, topk))


@pytest.mark.parametrize("block_size,ratio,span", [(8, 4, 8), (8, 128, 128), (4, 8, 8), (16, 4, 4), (8, 8, 16)])
def test_emission_plan_equals_the_native(block_size, ratio, span):
    """Every field of the plan, for entry slots with -1 pads (a static batch's every-row emission) and entries whose
    window starts before position 0."""
    R, width = 3, 40
    tables = _tables(R, width, seed=ratio + span)
    g = torch.Generator().manual_seed(block_size)
    T = 11
    req = torch.randint(0, R, (T,), generator=g).to(DEVICE)
    last_entry = width * block_size // ratio
    j = torch.randint(0, last_entry, (T,), generator=g)
    j[:3] = torch.tensor([0, 1, 0])  # windows reaching before position 0 (overlapping spans)
    positions = ((j + 1) * ratio - 1).to(DEVICE)
    emit = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, 6, 7, 8, 9, 10, -1], device=DEVICE)
    args = (emit, positions, req, tables, block_size, ratio, span, 999, 555)
    got = tri_idx.emission_plan(*args)
    want = _emission_plan_native(*args)
    names = ("last", "entry_ids", "first", "gather", "missing", "attn_rows", "key_rows")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got[5][emit < 0] == 999).all() and (got[6][emit < 0] == 555).all()


@pytest.mark.parametrize("per_query", [True, False], ids=["per_query", "by_request"])
def test_indexer_reads_keys_through_their_rows(per_query):
    """indexer_topk(..., key_rows): keys read from the pool through the rows = the gathered keys (the same ids)."""
    g = torch.Generator().manual_seed(3)
    T, ih, dim, C, S = 5, 4, 24, 37, 90
    q = torch.randn(T, ih, dim, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(T, ih, generator=g).to(DEVICE)
    pool = torch.randn(S, dim, generator=g).to(DEVICE)
    pool[7] = 0  # an all-zero key: ties broken towards the lower id
    req = torch.arange(T, device=DEVICE) % 2
    rows = torch.randint(0, S, (2, C), generator=g).to(DEVICE)
    rows[:, 4] = 7
    visible = torch.randint(0, C + 1, (T,), generator=g).to(DEVICE)
    key_rows, req_arg = (rows[req], None) if per_query else (rows, req)
    got = tri_comp.indexer_topk(q, w, pool, req_arg, visible, 16, 0.3, 0.5, key_rows)
    want = compressor.indexer_topk(q, w, pool[key_rows], req_arg, visible, 16, 0.3, 0.5)
    assert torch.equal(got, want)
    assert torch.equal(compressor.indexer_topk(q, w, pool, req_arg, visible, 16, 0.3, 0.5, key_rows), want)


@pytest.mark.parametrize("C,topk,W", [(37, 16, 8), (10, 16, 5), (200, 128, 128)])  # C < topk: padded
def test_indexer_writes_the_index_lists(C, topk, W):
    """indexer_topk(..., lists): the select launch writes chosen_rows(window, table, req, ids) (-1 pads -> -1)."""
    g = torch.Generator().manual_seed(C)
    T, ih, dim, R = 4, 4, 16, 2
    q = torch.randn(T, ih, dim, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(T, ih, generator=g).to(DEVICE)
    keys = torch.randn(T, C, dim, generator=g).to(DEVICE)
    visible = torch.tensor([C, 3, 0, C // 2], device=DEVICE)  # 0 visible: a row of -1 pads
    req = torch.tensor([1, 0, 1, 0], device=DEVICE)
    window = torch.randint(-1, 500, (T, W), generator=g).to(DEVICE)
    table = torch.cat([torch.randint(0, 500, (R, C), generator=g), torch.full((R, 1), -1)], dim=1).to(DEVICE)
    lists = (window, table, req)
    ids = compressor.indexer_topk(q, w, keys, None, visible, topk, 0.3)
    want = _chosen_rows_native(window, table, req, ids)
    got = tri_comp.indexer_topk(q, w, keys, None, visible, topk, 0.3, 1.0, None, lists)
    assert got.shape == (T, W + topk) and torch.equal(got, want)
    assert torch.equal(compressor.indexer_topk(q, w, keys, None, visible, topk, 0.3, 1.0, None, lists), want)


def test_preconditions_are_messages():
    tables = _tables(2, 4, seed=0)
    with pytest.raises(ValueError, match="ratio 3 must divide"):
        tri_idx.pool_rows(tables, torch.zeros(2, dtype=torch.long, device=DEVICE),
                          torch.zeros(2, dtype=torch.long, device=DEVICE), 8, 8, 0, 3)
    with pytest.raises(ValueError, match=r"topk must be \[2, K\]"):
        tri_idx.chosen_rows(torch.zeros(2, 4, dtype=torch.long, device=DEVICE),
                            torch.zeros(2, 3, dtype=torch.long, device=DEVICE),
                            torch.zeros(2, dtype=torch.long, device=DEVICE),
                            torch.zeros(3, 5, dtype=torch.long, device=DEVICE))
