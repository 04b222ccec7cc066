"""Sparse MQA attention over per-query index lists with a per-head sink (Triton).

Legend: T query tokens, h heads, D latent width (K = V), S pooled KV rows, W index width.
One program owns one query token and BLOCK_H heads; it walks the token's index list in tiles of
BLOCK_N rows, gathers each tile's latent rows once (they are both K and V) and keeps an online softmax
in fp32. The sink is the softmax's starting state: running max = sink, running sum = exp(0) = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkspec.ops.registry import accelerated
from sparkspec.ops.triton_kernels.common import check, next_pow2, on_interpreter, same_device

LOG2E = 1.4426950408889634


@triton.jit
def _sparse_attention_kernel(
    q_ptr,  # [T, h, D] bf16/fp16/fp32
    kv_ptr,  # [S, D] same dtype family; rows are both K and V
    idx_ptr,  # [T, W] int32/int64 rows of kv, -1 = padding
    sink_ptr,  # [h] fp32 (may be -inf: no sink)
    out_ptr,  # [T, h, D] q.dtype
    num_heads,
    width,
    head_dim,
    scale_log2,  # softmax scale · log2(e): the kernel works in base 2
    stride_qt,
    stride_qh,
    stride_kv,
    stride_it,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,  # exact fp32 dots (fp32 inputs); else the backend default (tf32 is exact on bf16 operands)
    SKIP_EMPTY: tl.constexpr,  # 1: skip tiles that hold only padding
):
    # 1-D grid, head blocks of one token adjacent: they gather the same KV rows, which then hit in L2
    num_head_blocks = tl.cdiv(num_heads, BLOCK_H)
    t = (tl.program_id(0) // num_head_blocks).to(tl.int64)
    heads = (tl.program_id(0) % num_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    dim_ok = dims < head_dim

    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    m_i = sink  # [BLOCK_H] running max (base-2 logits)
    l_i = tl.where(sink == float("-inf"), 0.0, 1.0)  # [BLOCK_H] running denominator; the sink contributes 2^0
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    for n0 in range(0, width, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * stride_it + cols, mask=cols < width, other=-1)  # [BLOCK_N]
        valid = idx >= 0
        if tl.max(valid.to(tl.int32), axis=0) + (1 - SKIP_EMPTY) > 0:
            rows = tl.where(valid, idx, 0).to(tl.int64)
            kv = tl.load(kv_ptr + rows[:, None] * stride_kv + dims[None, :],
                         mask=valid[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            if IEEE:
                s = tl.dot(q, tl.trans(kv), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kv))
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep exp2 finite
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p, kv)
            m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


@dataclass(frozen=True)
class AttentionConfig:
    block_h: int = 16  # heads per program (tl.dot needs >= 16)
    block_n: int = 32  # index rows per tile
    num_warps: int = 4
    num_stages: int = 1
    skip_empty: bool = True


def default_config(num_heads: int, head_dim: int, interpreter: bool) -> AttentionConfig:
    if interpreter:
        return AttentionConfig(block_h=16, block_n=16, num_warps=4)
    # H200, Triton 3.6, h=64 D=512 W=640 (sparkspec.bench.kernels --sweep): H16 N32 w4 fastest at T=64 and T=1024
    return AttentionConfig(block_h=16, block_n=32, num_warps=4)


@accelerated("sparse_attention", "cuda", "rocm", "xpu")
def sparse_attention(
    q: torch.Tensor,  # [T, h, D]
    kv: torch.Tensor,  # [S, D]
    indices: torch.Tensor,  # [T, W] int, rows of kv; -1 = padding
    sink: torch.Tensor,  # [h] fp32
    scale: float,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `ops.attention.sparse_attention` -> [T, h, D] (q.dtype).

    A row whose entries are all padding and whose sink is -inf returns zeros (the native returns NaN)."""
    check(q.dim() == 3 and kv.dim() == 2 and indices.dim() == 2,
          f"sparse_attention: want q [T,h,D], kv [S,D], indices [T,W]; got {tuple(q.shape)}, {tuple(kv.shape)}, "
          f"{tuple(indices.shape)}")
    T, h, D = q.shape
    check(kv.shape[1] == D, f"sparse_attention: kv width {kv.shape[1]} != q head dim {D}")
    check(indices.shape[0] == T, f"sparse_attention: indices rows {indices.shape[0]} != tokens {T}")
    check(sink.numel() == h, f"sparse_attention: sink has {sink.numel()} entries, want one per head ({h})")
    check(not indices.dtype.is_floating_point, f"sparse_attention: indices must be integer, got {indices.dtype}")
    check(same_device(q, kv, indices, sink), "sparse_attention: q, kv, indices and sink must share a device")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0 or h == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    sink = sink.float().contiguous()
    cfg = config or default_config(h, D, on_interpreter(q))
    grid = (T * triton.cdiv(h, cfg.block_h),)
    _sparse_attention_kernel[grid](
        q, kv, indices, sink, out,
        h, indices.shape[1], D, float(scale) * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_D=max(next_pow2(D), 16),
        IEEE=q.dtype == torch.float32 or kv.dtype == torch.float32, SKIP_EMPTY=int(cfg.skip_empty),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
