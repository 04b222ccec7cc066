"""Manifold-constrained hyper-connections (mHC). Legend: T tokens, n hc streams, H hidden, M = (2+n)·n mixes."""

from __future__ import annotations

import torch

from sparkspec.ops.registry import native


def _rms_noweight(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


@native("mhc_pre")
def mhc_pre(
    x: torch.Tensor,  # [T, n, H] residual streams
    fn: torch.Tensor,  # [M, n*H]
    scale: torch.Tensor,  # [3]  (pre, post, comb)
    base: torch.Tensor,  # [M]
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,  # [H] the sublayer's RMSNorm, applied to the layer input when given
    norm_eps: float | None = None,
    fp32_copy: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Collapse the streams into one sublayer input.

    Returns (layer_input [T, H] in x.dtype, post [T, n] fp32, comb [T, n, n] fp32) where comb is made
    doubly stochastic by softmax + Sinkhorn (`sinkhorn_iters` normalisation passes in total). With `norm_weight`
    the layer input comes normalised: `rms_norm(layer_input, norm_weight, norm_eps)` of the rounded input (the
    sublayer's norm taken in the same launch where a kernel is registered). `fp32_copy`: a fourth output,
    `layer_input.float()`, for the sublayer's fp32 GEMMs (the router, the compressor), written by the same launch.
    """
    T, n, H = x.shape
    flat = _rms_noweight(x.reshape(T, n * H).float(), rms_eps)
    mixes = flat @ fn.float().t()  # [T, M]
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2.0 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(T, n, n) * s[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    layer_input = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    if norm_weight is not None:
        from sparkspec.ops.rope import rms_norm

        layer_input = rms_norm(layer_input, norm_weight, norm_eps)
    return (layer_input, post, comb, layer_input.float()) if fp32_copy else (layer_input, post, comb)


@native("mhc_post")
def mhc_post(
    y: torch.Tensor,  # [T, H] sublayer output
    x: torch.Tensor,  # [T, n, H] streams entering the sublayer
    post: torch.Tensor,  # [T, n]
    comb: torch.Tensor,  # [T, n, n]
) -> torch.Tensor:
    """New streams: X'[j] = post[j]·y + Σ_i comb[i, j]·X[i]  -> [T, n, H]."""
    dtype = x.dtype
    out = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)
    return out


@native("mhc_post_pre")
def mhc_post_pre(
    y: torch.Tensor,  # [T, H] sublayer output
    x: torch.Tensor,  # [T, n, H] streams entering the sublayer
    post: torch.Tensor,  # [T, n]
    comb: torch.Tensor,  # [T, n, n]
    fn: torch.Tensor,  # [M, n*H] the next sublayer's mixes
    scale: torch.Tensor,  # [3]
    base: torch.Tensor,  # [M]
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,  # [H]
    norm_eps: float | None = None,
    fp32_copy: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`mhc_post` of one sublayer, then `mhc_pre` of the next on the new streams -> (streams [T, n, H] x.dtype,
    layer_input [T, H], post [T, n], comb [T, n, n] [, layer_input in fp32 with `fp32_copy`]). One op so that an
    accelerator can take the next sublayer's split-K mixes from the streams while it writes them (one launch fewer
    per sublayer boundary). The native runs
    `ops.mhc_post` and `ops.mhc_pre`, so that it is what they are wherever it runs (their compiled references in
    training, their natives on a CPU)."""
    from sparkspec.ops.registry import ops  # the pieces through the table: training's compiled references serve

    streams = ops.mhc_post(y, x, post, comb)
    return (streams, *ops.mhc_pre(streams, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm_weight, norm_eps,
                                  fp32_copy))


@native("hc_head")
def hc_head(
    x: torch.Tensor,  # [T, n, H]
    fn: torch.Tensor,  # [n, n*H]
    scale: torch.Tensor,  # [1]
    base: torch.Tensor,  # [n]
    rms_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    """Final collapse of the streams before the model norm -> [T, H]."""
    T, n, H = x.shape
    flat = _rms_noweight(x.reshape(T, n * H).float(), rms_eps)
    pre = torch.sigmoid((flat @ fn.float().t()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
