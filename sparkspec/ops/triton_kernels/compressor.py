"""KV compression (Triton): per-token state stores and whole-entry emission, one launch each.

Legend: T tokens, S state-pool rows, w state width (2d for overlapping windows, else d), M entry slots, span
state rows pooled per entry (R), d entry width, P = d / 2 feature pairs, R' rotary dims (the last R' of d).

`emit_entries` pools in programs of (entry slot, BLOCK_P feature pairs): each walks the entry's state rows in
tiles of BLOCK_S, keeping a per-feature online softmax of the gate scores, with even and odd features apart (a
RoPE pair is then (even[i], odd[i]) in registers). A second launch, one program per entry, applies the RMS norm
(which needs the whole entry) and the rotation before the one store. One program per whole entry (the first
version) held [32, 256]-element tiles per load at d = 512 in one CTA: ~160 us per call on the H200 at batch 1
and 8, against 6 us at d = 128.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkspec.ops.registry import accelerated, ops
from sparkspec.ops.triton_kernels.common import check, next_pow2, on_interpreter, same_device


@triton.jit
def _store_states_kernel(
    kv_ptr,  # [S, w] fp32
    score_ptr,  # [S, w] fp32
    rows_ptr,  # [T] int pool rows
    states_ptr,  # [T, 2w] kv then score
    ape_ptr,  # [ratio, w]
    pos_ptr,  # [T] int positions (>= 0)
    width,  # w
    ratio,
    stride_pool,
    stride_states,
    stride_ape,
    BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + t).to(tl.int64)
    phase = tl.load(pos_ptr + t).to(tl.int64) % ratio
    cols = tl.arange(0, BLOCK_W)
    ok = cols < width
    kv = tl.load(states_ptr + t * stride_states + cols, mask=ok, other=0.0).to(tl.float32)
    score = tl.load(states_ptr + t * stride_states + width + cols, mask=ok, other=0.0).to(tl.float32)
    score += tl.load(ape_ptr + phase * stride_ape + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(kv_ptr + row * stride_pool + cols, kv, mask=ok)
    tl.store(score_ptr + row * stride_pool + cols, score, mask=ok)


@accelerated("store_states", "cuda", "rocm", "xpu")
def store_states(
    kv_pool: torch.Tensor,  # [S, w] fp32
    score_pool: torch.Tensor,  # [S, w] fp32
    rows: torch.Tensor,  # [T]
    states: torch.Tensor,  # [T, 2w]
    ape: torch.Tensor,  # [ratio, w]
    positions: torch.Tensor,  # [T]
) -> None:
    """Triton twin of `ops.compressor.store_states` (writes the pools in place)."""
    check(kv_pool.dim() == 2 and kv_pool.shape == score_pool.shape, f"store_states: pools must be one [S, w] "
          f"shape, got {tuple(kv_pool.shape)} and {tuple(score_pool.shape)}")
    check(kv_pool.dtype == score_pool.dtype == torch.float32, "store_states: state pools must be fp32")
    check(kv_pool.is_contiguous() and score_pool.is_contiguous(), "store_states: pools must be contiguous")
    T, w = rows.shape[0], kv_pool.shape[1]
    check(tuple(states.shape) == (T, 2 * w), f"store_states: states must be [{T}, {2 * w}], got "
          f"{tuple(states.shape)}")
    check(ape.dim() == 2 and ape.shape[1] == w, f"store_states: ape must be [ratio, {w}], got {tuple(ape.shape)}")
    check(positions.shape == rows.shape, "store_states: positions and rows must both be [T]")
    check(same_device(kv_pool, score_pool, rows, states, ape, positions), "store_states: one device for all")
    if T == 0:
        return
    states = states if states.stride(-1) == 1 else states.contiguous()
    ape = ape if ape.stride(-1) == 1 else ape.contiguous()
    _store_states_kernel[(T,)](
        kv_pool, score_pool, rows, states, ape, positions, w, ape.shape[0], kv_pool.stride(0), states.stride(0),
        ape.stride(0), BLOCK_W=next_pow2(w), num_warps=4,
    )


@triton.jit
def _emit_pool_kernel(
    kv_ptr,  # [S, w] fp32
    score_ptr,  # [S, w] fp32
    gather_ptr,  # [M, span] int state rows
    missing_ptr,  # [M, span] uint8: 1 = no such position
    pooled_ptr,  # [M, d] fp32 scratch: the pooled entry before its norm
    span,
    num_pairs,  # P = d / 2
    stride_pool,
    OVERLAP: tl.constexpr,  # w = 2d: the first span / 2 rows are the previous window (first-half features)
    BLOCK_S: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One program per (entry slot, BLOCK_P feature pairs): the per-feature online softmax over the span."""
    m = tl.program_id(0).to(tl.int64)
    pairs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_ok = pairs < num_pairs
    even = 2 * pairs
    # a pad slot (last = -1) is the only one whose newest position is missing: it reads and writes nothing
    num_rows = tl.where(tl.load(missing_ptr + m * span + span - 1) == 0, span, 0)
    max_e = tl.full([BLOCK_P], float("-inf"), tl.float32)
    max_o = tl.full([BLOCK_P], float("-inf"), tl.float32)
    sum_e = tl.zeros([BLOCK_P], tl.float32)
    sum_o = tl.zeros([BLOCK_P], tl.float32)
    acc_e = tl.zeros([BLOCK_P], tl.float32)
    acc_o = tl.zeros([BLOCK_P], tl.float32)
    for s0 in range(0, num_rows, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < span
        rows = tl.load(gather_ptr + m * span + s, mask=s_ok, other=0).to(tl.int64)
        dead = s < 0  # [BLOCK_S] rows left out of the softmax
        col0 = s * 0
        if OVERLAP:
            previous = s < span // 2
            missing = tl.load(missing_ptr + m * span + s, mask=s_ok, other=0) != 0
            dead = missing & previous
            col0 = tl.where(previous, 0, 2 * num_pairs)
        dead = dead | ~s_ok
        off = rows[:, None] * stride_pool + col0[:, None] + even[None, :]  # [BLOCK_S, BLOCK_P]
        mask = s_ok[:, None] & pair_ok[None, :]
        kv_e = tl.load(kv_ptr + off, mask=mask, other=0.0)
        kv_o = tl.load(kv_ptr + off + 1, mask=mask, other=0.0)
        sc_e = tl.where(dead[:, None], float("-inf"), tl.load(score_ptr + off, mask=mask, other=0.0))
        sc_o = tl.where(dead[:, None], float("-inf"), tl.load(score_ptr + off + 1, mask=mask, other=0.0))
        new_e = tl.maximum(max_e, tl.max(sc_e, axis=0))
        new_o = tl.maximum(max_o, tl.max(sc_o, axis=0))
        safe_e = tl.where(new_e == float("-inf"), 0.0, new_e)  # nothing alive yet: keep exp finite
        safe_o = tl.where(new_o == float("-inf"), 0.0, new_o)
        p_e = tl.exp(sc_e - safe_e[None, :])
        p_o = tl.exp(sc_o - safe_o[None, :])
        alpha_e = tl.exp(max_e - safe_e)
        alpha_o = tl.exp(max_o - safe_o)
        sum_e = sum_e * alpha_e + tl.sum(p_e, axis=0)
        sum_o = sum_o * alpha_o + tl.sum(p_o, axis=0)
        acc_e = acc_e * alpha_e + tl.sum(p_e * kv_e, axis=0)
        acc_o = acc_o * alpha_o + tl.sum(p_o * kv_o, axis=0)
        max_e, max_o = new_e, new_o
    ok = pairs < tl.where(num_rows > 0, num_pairs, 0)
    tl.store(pooled_ptr + m * 2 * num_pairs + even, acc_e / sum_e, mask=ok)
    tl.store(pooled_ptr + m * 2 * num_pairs + even + 1, acc_o / sum_o, mask=ok)


@triton.jit
def _emit_finish_kernel(
    pooled_ptr,  # [M, d] fp32 pooled entries
    missing_ptr,  # [M, span] uint8
    weight_ptr,  # [d] norm weight
    rot_ptr,  # [M, R'/2, 2] fp32 (cos, sin)
    out_ptr,  # [S', d]
    out_rows_ptr,  # [M] int
    span,
    num_pairs,  # P = d / 2
    first_rot_pair,  # (d - R') / 2
    eps,
    stride_rot,
    stride_out,
    BLOCK_P: tl.constexpr,
):
    """One program per entry slot: RMS norm over the whole entry, RoPE on its last R' features, one store."""
    m = tl.program_id(0).to(tl.int64)
    pairs = tl.arange(0, BLOCK_P)
    pair_ok = pairs < num_pairs
    ok = pairs < tl.where(tl.load(missing_ptr + m * span + span - 1) == 0, num_pairs, 0)  # pad slots: nothing
    even = 2 * pairs
    x_e = tl.load(pooled_ptr + m * 2 * num_pairs + even, mask=ok, other=0.0)
    x_o = tl.load(pooled_ptr + m * 2 * num_pairs + even + 1, mask=ok, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x_e * x_e + x_o * x_o, axis=0) / (2 * num_pairs) + eps)
    x_e = x_e * rstd * tl.load(weight_ptr + even, mask=pair_ok, other=0.0).to(tl.float32)
    x_o = x_o * rstd * tl.load(weight_ptr + even + 1, mask=pair_ok, other=0.0).to(tl.float32)
    k = pairs - first_rot_pair
    in_rot = ok & (k >= 0)
    cos = tl.load(rot_ptr + m * stride_rot + 2 * k, mask=in_rot, other=1.0)  # unrotated pairs: cos 1, sin 0
    sin = tl.load(rot_ptr + m * stride_rot + 2 * k + 1, mask=in_rot, other=0.0)
    row = tl.load(out_rows_ptr + m).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_out + even, (x_e * cos - x_o * sin).to(dtype), mask=ok)
    tl.store(out_ptr + row * stride_out + even + 1, (x_e * sin + x_o * cos).to(dtype), mask=ok)


EMIT_BLOCK_P = 32  # feature pairs per pooling program: d = 512 -> 8 programs per entry, [32, 32] tiles in registers


@accelerated("emit_entries", "cuda", "rocm", "xpu")
def emit_entries(
    kv_pool: torch.Tensor,  # [S, w] fp32
    score_pool: torch.Tensor,  # [S, w] fp32
    gather: torch.Tensor,  # [M, span]
    missing: torch.Tensor,  # [M, span] bool
    norm_weight: torch.Tensor,  # [d]
    eps: float,
    rot: torch.Tensor,  # [M, R'/2] complex64
    out: torch.Tensor,  # [S', d]
    out_rows: torch.Tensor,  # [M]
) -> None:
    """Triton twin of `ops.compressor.emit_entries` (writes `out` in place), in two launches: the pooling split
    over (entry, feature block) into an fp32 scratch, then the norm and rotation per entry. Pad slots (their newest
    position missing, i.e. last = -1) read and write nothing; the native writes a value to their trash row."""
    d = norm_weight.numel()
    check(kv_pool.dim() == 2 and kv_pool.shape == score_pool.shape, f"emit_entries: pools must be one [S, w] "
          f"shape, got {tuple(kv_pool.shape)} and {tuple(score_pool.shape)}")
    check(kv_pool.dtype == score_pool.dtype == torch.float32, "emit_entries: state pools must be fp32")
    check(kv_pool.is_contiguous() and score_pool.is_contiguous(), "emit_entries: pools must be contiguous")
    w = kv_pool.shape[1]
    check(d % 2 == 0 and w in (d, 2 * d), f"emit_entries: state width {w} must be d or 2d for an even d = {d}")
    M, span = gather.shape
    check(missing.shape == gather.shape and missing.dtype == torch.bool,
          f"emit_entries: missing must be bool {tuple(gather.shape)}, got {missing.dtype} {tuple(missing.shape)}")
    check(w == d or span % 2 == 0, f"emit_entries: overlapping windows need an even span, got {span}")
    check(rot.is_complex() and rot.dim() == 2 and rot.shape[0] == M and 2 * rot.shape[1] <= d,
          f"emit_entries: rot must be complex [{M}, <= {d // 2}], got {rot.dtype} {tuple(rot.shape)}")
    check(out.dim() == 2 and out.shape[1] == d and out.stride(1) == 1, f"emit_entries: out must be [S', {d}] "
          f"with unit feature stride, got {tuple(out.shape)}")
    check(out_rows.shape == (M,), f"emit_entries: out_rows must be [{M}], got {tuple(out_rows.shape)}")
    check(same_device(kv_pool, score_pool, gather, missing, norm_weight, rot, out, out_rows),
          "emit_entries: one device for all")
    if M == 0 or span == 0:
        return
    gather = gather if gather.is_contiguous() else gather.contiguous()
    missing = (missing if missing.is_contiguous() else missing.contiguous()).view(torch.uint8)
    rot_real = torch.view_as_real(rot.resolve_conj())
    rot_real = rot_real if rot_real.is_contiguous() else rot_real.contiguous()
    pooled = torch.empty(M, d, dtype=torch.float32, device=out.device)  # [M, d]
    P = d // 2
    block_p = min(next_pow2(P), EMIT_BLOCK_P)
    _emit_pool_kernel[(M, triton.cdiv(P, block_p))](
        kv_pool, score_pool, gather, missing, pooled, span, P, kv_pool.stride(0), OVERLAP=w == 2 * d,
        BLOCK_S=min(next_pow2(span), 32), BLOCK_P=block_p, num_warps=4,
    )
    _emit_finish_kernel[(M,)](
        pooled, missing, norm_weight.contiguous(), rot_real, out, out_rows, span, P, (d - 2 * rot.shape[1]) // 2,
        float(eps), rot_real.stride(0), out.stride(0), BLOCK_P=next_pow2(P), num_warps=4,
    )


@triton.jit
def _split3_bf16(x):
    """fp32 x -> three bf16 pieces with x == a + b + c exactly (8 significant bits each, 24 in all; round or
    truncate, either leaves a remainder the next piece holds exactly)."""
    a = x.to(tl.bfloat16)
    r = x - a.to(tl.float32)
    b = r.to(tl.bfloat16)
    c = (r - b.to(tl.float32)).to(tl.bfloat16)
    return a, b, c


@triton.jit
def _exact_dot_t(q, k, SPLIT: tl.constexpr, BF16_DOT: tl.constexpr):
    """q [BM, BD] @ k [BN, BD]^T in fp32. SPLIT (q holds bf16 values, k fp32): k as three bf16 pieces, three
    dots with exact products and fp32 sums (tensor cores with BF16_DOT; in the interpreter, whose bf16 dots are
    wrong, the same pieces as fp32 through ieee dots). Else one ieee (FMA) fp32 dot."""
    if SPLIT:
        k1, k2, k3 = _split3_bf16(k)
        if BF16_DOT:
            qb = q.to(tl.bfloat16)
            s = tl.dot(qb, tl.trans(k1))
            s = tl.dot(qb, tl.trans(k2), s)
            s = tl.dot(qb, tl.trans(k3), s)
        else:
            qf = q.to(tl.float32)
            s = tl.dot(qf, tl.trans(k1.to(tl.float32)), input_precision="ieee")
            s = tl.dot(qf, tl.trans(k2.to(tl.float32)), s, input_precision="ieee")
            s = tl.dot(qf, tl.trans(k3.to(tl.float32)), s, input_precision="ieee")
    else:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    return s


@triton.jit
def _indexer_scores_kernel(
    q_ptr,  # [T, ih, id] indexer queries
    w_ptr,  # [T, ih] per-head weights
    keys_ptr,  # [K, C, id] keys (K = R with req_ptr, else T); with HAS_ROWS a pool [S, id]
    rows_ptr,  # [K, C] int rows of the pool (read only with HAS_ROWS; row stride stride_kr)
    req_ptr,  # [T] int key set of each query (read only when HAS_REQ)
    visible_ptr,  # [T] int: entries j < visible may be chosen
    out_ptr,  # [T, C] fp32 scores, -inf where not visible
    num_heads,
    num_entries,  # C
    head_dim,
    scale,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kr,
    stride_kc,
    weight_scale,
    HAS_REQ: tl.constexpr,
    HAS_ROWS: tl.constexpr,  # keys through rows_ptr (stride_kc: the pool's row stride)
    SPLIT: tl.constexpr,  # see _exact_dot_t
    BF16_DOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok, col_ok, dim_ok = heads < num_heads, cols < num_entries, dims < head_dim
    visible = tl.load(visible_ptr + t)
    col_ok = col_ok & (cols < visible)  # invisible keys are never read
    key_set = tl.load(req_ptr + t).to(tl.int64) if HAS_REQ else t
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if HAS_ROWS:
        rows = tl.load(rows_ptr + key_set * stride_kr + cols, mask=col_ok, other=0).to(tl.int64)  # [BLOCK_C]
        k_off = rows[:, None] * stride_kc + dims[None, :]
    else:
        k_off = key_set * stride_kr + cols[:, None].to(tl.int64) * stride_kc + dims[None, :]
    k = tl.load(keys_ptr + k_off, mask=col_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_C, D]
    s = tl.maximum(_exact_dot_t(q, k, SPLIT, BF16_DOT), 0.0) * scale  # [BLOCK_H, BLOCK_C]
    w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32) * weight_scale
    score = tl.sum(s * w[:, None], axis=0)  # [BLOCK_C]
    score = tl.where(cols < visible, score, float("-inf"))
    tl.store(out_ptr + t * num_entries + cols, score, mask=cols < num_entries)


@triton.jit
def _topk_select_kernel(
    scores_ptr,  # [T, C] fp32 (-inf: not visible)
    out_ptr,  # [T, topk] int64 chosen entries, -1 padded; with LISTS [T, W + topk] int64 index lists
    window_ptr,  # [T, W] int64 window rows (read only with LISTS; row stride stride_w)
    table_ptr,  # [R, E + 1] int64 entry rows then -1 (read only with LISTS; row stride stride_tab)
    req_ptr,  # [T] request of each query (read only with LISTS)
    num_entries,  # C
    k,  # min(topk, C)
    topk,
    window,  # W (0 without LISTS)
    stride_w,
    stride_tab,
    table_entries,  # E: the table's -1 column
    BLOCK_C: tl.constexpr,  # >= C, a power of two
    LISTS: tl.constexpr,  # write the window rows, then the chosen entries' table rows (`chosen_rows`)
):
    """One row: the stable descending sort of `torch.sort` by one bitonic sort of int64 keys (the score's bits,
    made monotone, above the reversed entry id: equal scores keep id order), -inf entries -> -1. With LISTS the
    row's attention index list instead: its window rows, then table[req, id] (-1 ids: the table's -1 column)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    s = tl.load(scores_ptr + t * num_entries + cols, mask=cols < num_entries, other=float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)  # -0 and +0 are one score to the sort (ties in id order)
    bits = s.to(tl.int32, bitcast=True).to(tl.int64)
    mono = tl.where(bits >= 0, bits, -(bits + 2147483648) - 1)  # order-preserving: the float order as integers
    key = mono * 4294967296 + (4294967295 - cols.to(tl.int64))
    key = tl.sort(key, descending=True)
    ids = 4294967295 - (key & 4294967295)
    ids = tl.where((key >> 32) <= -2139095041, -1, ids)  # -2139095041: -inf's monotone bits
    row = out_ptr + t * (window + topk)
    if LISTS:
        for w0 in range(0, window, BLOCK_C):
            ws = w0 + cols
            tl.store(row + ws, tl.load(window_ptr + t * stride_w + ws, mask=ws < window), mask=ws < window)
        r = tl.load(req_ptr + t).to(tl.int64)
        ids = tl.load(table_ptr + r * stride_tab + tl.where(ids >= 0, ids, table_entries), mask=cols < k, other=-1)
    tl.store(row + window + cols, ids, mask=cols < k)
    for j0 in range(0, topk, BLOCK_C):  # pads past k (when C < topk): -1, an id or a row
        js = j0 + cols
        tl.store(row + window + js, tl.full([BLOCK_C], -1, tl.int64), mask=(js >= k) & (js < topk))


TOPK_SELECT_MAX_ENTRIES = 4096  # C above: torch.sort (one program holds a row's keys in registers)


@accelerated("indexer_topk", "cuda", "rocm", "xpu")
def indexer_topk(
    q: torch.Tensor,  # [T, ih, id]
    weights: torch.Tensor,  # [T, ih]
    keys: torch.Tensor,  # [R, C, id], or [T, C, id] when req_idx is None
    req_idx: torch.Tensor | None,  # [T]
    num_visible: torch.Tensor,  # [T]
    topk: int,
    scale: float,
    weight_scale: float = 1.0,
    key_rows: torch.Tensor | None = None,  # [R or T, C] rows of keys (then a pool [S, id])
    lists: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # (window rows, entry table, req)
) -> torch.Tensor:
    """Triton twin of `ops.compressor.indexer_topk`: the scores in one launch (with `key_rows`, the keys read from
    their pool through the rows: no gather first), then the top-k by one more (a per-row bitonic sort giving
    `torch.sort`'s stable order: the same ids; over TOPK_SELECT_MAX_ENTRIES entries the native's sort).

    bf16 queries against fp32 keys (the model's case) run three bf16 tensor-core dots on the keys' exact bf16
    pieces: the products are exact, only the fp32 summation order differs from the native. Other dtypes take one
    ieee fp32 dot (FMA: ~60 us per (query, 32 keys) program on the H200 at ih = 64, id = 128)."""
    if key_rows is not None:
        check(keys.dim() == 2 and key_rows.dim() == 2 and q.dim() == 3 and q.shape[2] == keys.shape[1],
              f"indexer_topk: with key_rows, want q [T, ih, id], keys [S, id] and key_rows [*, C], got "
              f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(key_rows.shape)}")
    else:
        check(q.dim() == 3 and keys.dim() == 3 and q.shape[2] == keys.shape[2],
              f"indexer_topk: want q [T, ih, id] and keys [*, C, id], got {tuple(q.shape)} and {tuple(keys.shape)}")
    T, ih, dim = q.shape
    sets = key_rows if key_rows is not None else keys  # [K, C, ...]
    C = sets.shape[1]
    check(tuple(weights.shape) == (T, ih), f"indexer_topk: weights must be [{T}, {ih}], got {tuple(weights.shape)}")
    check(req_idx is not None or sets.shape[0] == T, f"indexer_topk: keys per query must be [{T}, C, id], got "
          f"{tuple(sets.shape)}")
    check(num_visible.shape == (T,), f"indexer_topk: num_visible must be [{T}], got {tuple(num_visible.shape)}")
    check(same_device(q, weights, keys, num_visible), "indexer_topk: one device for all")
    k = min(topk, C)
    if k == 0 or T == 0 or (lists is not None and C > TOPK_SELECT_MAX_ENTRIES):  # lists from the ids
        if lists is not None:
            ids = indexer_topk(q, weights, keys, req_idx, num_visible, topk, scale, weight_scale, key_rows)
            return ops.chosen_rows(lists[0], lists[1], lists[2], ids)
        return torch.full((T, topk), -1, dtype=torch.long, device=q.device)
    split = q.dtype == torch.bfloat16 and keys.dtype in (torch.float32, torch.bfloat16)
    keys = keys if keys.dtype in (torch.float32, torch.bfloat16) else keys.float()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    scores = torch.empty(T, C, dtype=torch.float32, device=q.device)
    block_c = 64 if split else 32
    if key_rows is not None:
        key_rows = key_rows if key_rows.stride(-1) == 1 else key_rows.contiguous()
        stride_kr, stride_kc = key_rows.stride(0), keys.stride(0)
    else:
        stride_kr, stride_kc = keys.stride(0), keys.stride(1)
    _indexer_scores_kernel[(T, triton.cdiv(C, block_c))](
        q, weights, keys, key_rows if key_rows is not None else num_visible,
        req_idx if req_idx is not None else num_visible, num_visible, scores, ih, C, dim,
        float(scale), q.stride(0), q.stride(1), weights.stride(0), stride_kr, stride_kc, float(weight_scale),
        HAS_REQ=req_idx is not None, HAS_ROWS=key_rows is not None, SPLIT=split,
        BF16_DOT=split and not on_interpreter(q), BLOCK_H=max(next_pow2(ih), 16), BLOCK_C=block_c,
        BLOCK_D=max(next_pow2(dim), 16), num_warps=4,
    )
    if C > TOPK_SELECT_MAX_ENTRIES:
        values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        ids = torch.where(values[:, :k] > float("-inf"), order[:, :k], -1)
        return ids if k == topk else torch.nn.functional.pad(ids, (0, topk - k), value=-1)
    block = max(next_pow2(C), 16)
    if lists is None:
        ids = torch.empty(T, topk, dtype=torch.long, device=q.device)
        _topk_select_kernel[(T,)](scores, ids, ids, ids, ids, C, k, topk, 0, 0, 0, 0, BLOCK_C=block, LISTS=False,
                                  num_warps=4 if block <= 1024 else 8)
        return ids
    window_rows, table, req = lists
    check(window_rows.dim() == 2 and window_rows.shape[0] == T and table.dim() == 2 and req.shape == (T,)
          and window_rows.dtype == table.dtype == torch.int64,
          f"indexer_topk: lists must be (window rows [{T}, W] int64, entry table [R, E + 1] int64, req [{T}]), got "
          f"{tuple(window_rows.shape)}, {tuple(table.shape)}, {tuple(req.shape)}")
    window_rows, table = (x if x.stride(-1) == 1 else x.contiguous() for x in (window_rows, table))
    W = window_rows.shape[1]
    out = torch.empty(T, W + topk, dtype=torch.long, device=q.device)
    _topk_select_kernel[(T,)](scores, out, window_rows, table, req, C, k, topk, W, window_rows.stride(0),
                              table.stride(0), table.shape[1] - 1, BLOCK_C=block, LISTS=True,
                              num_warps=4 if block <= 1024 else 8)
    return out
