"""Batch-invariant mode: a row's result never depends on how many rows the step has or where the row sits.

Legend: M rows (tokens of the step), N output features, K input features, B matrices of a batched GEMM.

Why: in bf16 on a GPU a request's greedy tokens changed with its batch (plain decoding of 31 prompts in one batch
matched one-at-a-time on 12 of 31 on an H200), because cuBLAS picks its algorithm and split-K by M and some of our
kernels pick their tile by the row count, so the order of a row's fp32 sums, and its rounding, moved with the
batch. In this mode (`set_batch_invariant(True)`, `EngineConfig.batch_invariant`, `--batch-invariant`):

* every dense GEMM on an accelerator tensor (`aten::mm`, `addmm`, `bmm`, `mv`: nn.Linear / F.linear, `@`, `matmul`,
  `einsum`, in the target, the drafters and the natives that run there) goes to `matmul_invariant`
  (`triton_kernels.batch_invariant`: a tile and K split fixed by the weight's shape, chunk partials added in
  chunk order, fp32 accumulation). It is registered as the CUDA kernel of those aten ops (torch.library), so no
  call site changes and none can be missed;
* ops whose accelerated versions choose a tile or a path by the row count use their `invariant` registrations
  in the op table (`registry.invariant`): the LM head (its BLOCK_M fixed at 64), the FP8 block linear (tile and
  split-K fixed by N and K only, never cuBLAS `scaled_mm`), the routed experts (the Triton kernels at every
  size with a fixed tile, never `torch._grouped_mm`; FP4 stacks with a fixed `Fp4Config`);
* the row-count-dependent configs inside our other kernels are pinned where they are chosen (`pinned()`):
  `triton_kernels.rope._launch` (rms_norm / rope: rows per program) and `triton_kernels.mhc._mixes` (mhc_pre /
  hc_head: the split-K count, otherwise chosen from the token blocks).

Per-row ops whose tiles depend on the feature width only (attention, indexer, compressor, mhc_post, mhc_post_pre:
its split count from H, torch softmax / argmax / topk) are invariant as they are. Not covered: torch reductions over
the vocabulary in the sampler for T > 0 (top-p's sums): greedy tokens do not use them.

The mode is process-wide: torch.library kernels and the op table are global. The PyTorch reference of the GEMM
is `matmul_reference` (fp32 matmul, one rounding): the test oracle.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from sparkspec.ops.registry import invariant, ops

_ENABLED = False
_LIBS: dict[str, torch.library.Library] = {}  # dispatch key -> the aten overrides registered for it
CALLS = {"mm": 0, "addmm": 0, "bmm": 0, "mv": 0}  # GEMMs routed to the invariant kernel (tests read it)


def pinned() -> bool:
    """Whether batch-invariant mode is on: kernels that choose a tile by the row count take their fixed one."""
    return _ENABLED


def matmul_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [.., M, K] · b [.., K, N] (+ bias [N]) in fp32, rounded once to a.dtype: the oracle of
    `matmul_invariant` (equal up to the order of the fp32 sums)."""
    c = torch.matmul(a.double(), b.double()).float()
    if bias is not None:
        c = c + bias.float()
    return c.to(a.dtype)


def _kernel():
    from sparkspec.ops.triton_kernels.batch_invariant import SUPPORTED_DTYPES, matmul_invariant

    return SUPPORTED_DTYPES, matmul_invariant


def _products_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · b without a GEMM (dtypes the kernel does not take: integers, fp64); slow, rare, order fixed by K."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · b by the invariant kernel where it takes the dtypes, else by `_products_sum`."""
    dtypes, matmul = _kernel()
    if a.dtype != b.dtype or a.dtype not in dtypes:
        return _products_sum(a, b)
    return matmul(a, b)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    CALLS["mm"] += 1
    return _product(a, b)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    CALLS["bmm"] += 1
    return _product(a, b)


def _mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """a [M, K] · v [K] (cuBLAS gemv otherwise): the GEMM with one column."""
    CALLS["mv"] += 1
    return _product(a, v.unsqueeze(1))[:, 0]


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """beta · bias + alpha · a · b; the linear case (beta = alpha = 1, a bias row) adds the bias in fp32 inside the
    kernel, before the one rounding."""
    dtypes, matmul = _kernel()
    CALLS["addmm"] += 1
    N = b.shape[1]
    row = bias.dim() >= 1 and bias.shape[-1] == N and bias.numel() == N and bias.dtype == a.dtype
    if a.dtype == b.dtype and a.dtype in dtypes and beta == 1 and alpha == 1 and row:
        return matmul(a, b, bias.reshape(N))
    c = _product(a, b)
    return (alpha * c.float() + beta * bias.float()).to(c.dtype)


def set_batch_invariant(enabled: bool, dispatch_keys: tuple[str, ...] = ("CUDA",)) -> None:
    """Turn the mode on or off for the whole process. `dispatch_keys`: where the aten GEMMs are replaced (tests
    pass ("CPU",) to run the kernel in Triton's interpreter); turning it off removes every replacement."""
    global _ENABLED
    _ENABLED = bool(enabled)
    ops.set_batch_invariant(_ENABLED)
    if not _ENABLED:
        for lib in _LIBS.values():
            lib._destroy()
        _LIBS.clear()
        return
    for key in dispatch_keys:
        if key in _LIBS:
            continue
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            for name, fn in (("mm", _mm), ("addmm", _addmm), ("bmm", _bmm), ("mv", _mv)):
                lib.impl(name, fn, key)
        _LIBS[key] = lib


def batch_invariant_enabled() -> bool:
    return _ENABLED


@contextmanager
def batch_invariant(dispatch_keys: tuple[str, ...] = ("CUDA",)) -> Iterator[None]:
    """The mode for the duration of a block (then off again)."""
    set_batch_invariant(True, dispatch_keys)
    try:
        yield
    finally:
        set_batch_invariant(False)


# ------------------------------------------------------------ invariant registrations of the op table


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


@invariant("lm_head", "cuda", "rocm", "xpu")
def lm_head_invariant(
    h: torch.Tensor,  # [T, H] fp32
    weight: torch.Tensor,  # [V, H]
    weight_fp32: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The Triton head with one tile for every row count (its default grows BLOCK_M with T); other weight dtypes:
    the native version, whose F.linear is the invariant GEMM in this mode."""
    from sparkspec.ops.head import lm_head

    if weight.dtype != torch.bfloat16 or h.dtype != torch.float32 or _needs_grad(h, weight):
        return lm_head(h, weight, weight_fp32)
    from sparkspec.ops.triton_kernels.head import HEAD_DECODE, lm_head_triton

    # the decode tile (16 rows) at every M: on the H200 free at batch 1 (271 us for V = 129,280, H = 4,096) and 925
    # us against the wide tile's 445 at 64 rows, +0.5 ms on a Flash step of ~28 ms (1.7 %); the 64-row tile at
    # every M would cost +0.17 ms on the 3.8 ms batch-1 step instead (4.5 %)
    return lm_head_triton(h, weight, config=HEAD_DECODE)


def fp8_invariant_config(N: int, K: int, device: torch.device):
    """The FP8 linear's tile for every row count: 16-row blocks computed as W·xᵀ (its decode choice), split over
    K into a count fixed by N and K (about 2 programs per SM at one row block), so no choice depends on M."""
    import triton

    from sparkspec.ops.triton_kernels.quant import CTAS_PER_SM, FP8_BLOCK, GemmConfig, num_sms

    if device.type == "cpu":  # the interpreter (tests)
        return GemmConfig(16, 16, 32, 4, 1, split_k=2, swap=True)
    split = max(1, min(triton.cdiv(K, FP8_BLOCK), (CTAS_PER_SM * num_sms(device)) // triton.cdiv(N, 64)))
    return GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=split, swap=True)


@invariant("fp8_block_linear", "cuda", "rocm", "xpu")
def fp8_block_linear_invariant(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N/128), ceil(K/128)] fp32
) -> torch.Tensor:
    """The Triton FP8 linear with `fp8_invariant_config` at every row count (never cuBLAS `scaled_mm`, whose
    algorithm and activation rounding depend on the batch)."""
    from sparkspec.ops.quant import fp8_block_linear

    if x.device.type == "cpu" or _needs_grad(x):
        return fp8_block_linear(x, weight, scale)
    from sparkspec.ops.triton_kernels.quant import fp8_block_linear_triton

    return fp8_block_linear_triton(x, weight, scale, config=fp8_invariant_config(*weight.shape, x.device))


def moe_tiles():
    """(plain MoeConfig, Fp4Config) of the routed experts at every size: the plain kernel's decode tile; FP4 on
    tensor-core tiles of 16 rows by 64 columns with K split in 2 (its default switches from one-row FMA programs
    to tiles by the pair count). On the H200 at the V4-Flash experts (E = 256, H = 4096, I = 2048, top-6) that
    FP4 tile took 106 us at one token and 2,646 at 64 (default: 85 and 2,602), where 16 x 32 without a split
    took 118 and 2,883 (`ops/triton_kernels/NOTES.md`)."""
    from sparkspec.ops.triton_kernels.moe import MoeConfig
    from sparkspec.ops.triton_kernels.moe_fp4 import Fp4Config

    return MoeConfig(block_m=16, block_k=128), Fp4Config(block_m=16, block_n=64, groups=4, split_k=2)


MOE_TOKEN_CHUNK = 8192  # tokens per launch of the invariant experts (a long prefill runs as several)


def in_token_chunks(fn: Callable[..., torch.Tensor], x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    shared: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """fn(x, weights, ids, shared) -> [T, H], over at most `chunk` tokens at a time, concatenated. Exact for an
    invariant fn (a token's row does not depend on the others), and it bounds the temporaries of a long prefill:
    the FP4 tile's two K-split partial sums are [2, T·A, H] fp32, 24 GB for 131k tokens of V4-Flash."""
    T = x.shape[0]
    if T <= chunk:
        return fn(x, weights, ids, shared)
    return torch.cat([fn(x[t:t + chunk], weights[t:t + chunk], ids[t:t + chunk],
                         None if shared is None else shared[t:t + chunk]) for t in range(0, T, chunk)])


@invariant("moe_experts", "cuda", "rocm", "xpu")
def moe_experts_invariant(x, w13, w2, weights, ids, limit: float, shared=None) -> torch.Tensor:
    """The Triton grouped GEMMs at every size with fixed tiles (`moe_tiles`), never `torch._grouped_mm`, over
    at most MOE_TOKEN_CHUNK tokens a launch (`in_token_chunks`). x [T, H], w13 [E, 2I, H], w2 [E, H, I] (plain
    or FP4 `Quantized`), weights / ids [T, A], shared [T, H] or None -> [T, H]."""
    from sparkspec.ops.formats import Quantized
    from sparkspec.ops.moe import moe_experts

    fp4 = isinstance(w13, Quantized)
    plain = () if fp4 else (w13, w2)
    if x.device.type == "cpu" or _needs_grad(x, *plain) or torch.is_autocast_enabled(x.device.type):
        return moe_experts(x, w13, w2, weights, ids, limit, shared)
    plain_tile, fp4_tile = moe_tiles()
    if fp4:
        from sparkspec.ops.triton_kernels.moe_fp4 import moe_experts_fp4

        def experts(xs, ws, es, sh):
            return moe_experts_fp4(xs, w13, w2, ws, es, limit, config=fp4_tile, shared=sh)
    else:
        from sparkspec.ops.triton_kernels.moe import moe_experts_triton

        def experts(xs, ws, es, sh):
            return moe_experts_triton(xs, w13, w2, ws, es, limit, config=plain_tile, shared=sh)
    return in_token_chunks(experts, x, weights, ids, shared, MOE_TOKEN_CHUNK)
