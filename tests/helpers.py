"""Tiny deterministic helpers that only the tests use: sampling tensors from `SamplingParams` lists, one sampled
token per row, FP8 / FP4 quantisers that write test checkpoints, and the bytes kept quantised."""

from __future__ import annotations

import torch
from torch import nn

from sparkspec.loading.quantized import Fp4Linear, Fp8Linear
from sparkspec.ops.formats import FP4_BLOCK, FP4_VALUES, FP8_BLOCK
from sparkspec.ops.sampling import STREAM_TARGET, SamplingTensors, probs_for, sample
from sparkspec.sampling_params import SamplingParams


def sampling_tensors(params: list[SamplingParams], device: torch.device | str,
                     seeds: list[int | None] | None = None) -> SamplingTensors:
    """The sampling tensors of `params` (the engine packs the same from its upload). seeds[i] is used when
    params[i].seed is None (a request's own seed wins). Greedy requests (below MIN_TEMPERATURE) are packed at
    temperature 0."""
    seeds = seeds if seeds is not None else [None] * len(params)
    chosen = [p.seed if p.seed is not None else s for p, s in zip(params, seeds, strict=True)]
    if any(s is None for s in chosen):
        raise ValueError("every request needs a seed: its own or one chosen by the caller")
    wrapped = [(s & (2**64 - 1)) - (2**64 if s & (1 << 63) else 0) for s in chosen]  # any int -> int64

    def t(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return SamplingTensors(
        temperature=t([p.device_temperature for p in params], torch.float32),
        top_k=t([p.top_k for p in params], torch.int64),
        top_p=t([p.top_p for p in params], torch.float32),
        seeds=t(wrapped, torch.int64),
        all_greedy=all(p.greedy for p in params),
        any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
        any_top_p=any(p.top_p < 1 and not p.greedy for p in params),
    )


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:  # both [C]
    """Pearson chi-square p-value; cells with zero expectation must be empty."""
    assert counts[expected == 0].sum() == 0, "drew an event of probability 0"
    keep = expected > 0
    c, e = counts[keep].double(), expected[keep].double()
    stat = ((c - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(e) - 1) / 2, dtype=torch.float64), stat / 2))


def sample_tokens(
    logits: torch.Tensor,  # [R, V]
    st: SamplingTensors,  # R rows
    offsets: torch.Tensor,  # [R] int64: absolute position of the token being produced
    stream: int = STREAM_TARGET,
) -> torch.Tensor:
    """One token per row -> [R] int64: greedy rows the argmax (ties: lowest id), others a draw from the
    processed distribution with the row's seed at (offset, stream)."""
    argmax = logits.argmax(-1)
    if st.all_greedy:
        return argmax
    return torch.where(st.greedy, argmax, sample(probs_for(logits, st), st.seeds, offsets, stream))


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse (power-of-two block scales), used to write test checkpoints."""
    out, inn = w.shape
    bo, bi = (out + FP8_BLOCK - 1) // FP8_BLOCK, (inn + FP8_BLOCK - 1) // FP8_BLOCK
    pad = torch.zeros(bo * FP8_BLOCK, bi * FP8_BLOCK)
    pad[:out, :inn] = w.float()
    blocks = pad.view(bo, FP8_BLOCK, bi, FP8_BLOCK).abs().amax(dim=(1, 3)).clamp(min=1e-8)
    scale = torch.exp2(torch.ceil(torch.log2(blocks / 448.0)))
    s = scale.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inn]
    return (w.float() / s).to(torch.float8_e4m3fn), scale


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest e2m1 code with power-of-two 1×32 scales -> (packed uint8 [out, in/2], e8m0 uint8 scales)."""
    out, inn = w.shape
    blocks = w.float().view(out, inn // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=1e-8)
    exp = torch.ceil(torch.log2(amax / 6.0))
    scale = torch.exp2(exp)
    scaled = (blocks / scale.unsqueeze(-1)).view(out, inn)
    codes = (scaled.unsqueeze(-1) - FP4_VALUES).abs().argmin(-1).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the parameters of the quantised layers (weights and scales)."""
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, (Fp8Linear, Fp4Linear))
               for p in m.parameters())
