"""Weights kept in their checkpoint formats: the FP8 block-scaled linear and the FP4 grouped MoE GEMM (Triton,
TRITON_INTERPRET=1 on a CPU) against dequantise-then-matmul; `load_checkpoint(quantization="keep")` against
"dequantize" (same logits, same greedy tokens through the engine, fewer parameter bytes); tensor-parallel
slices of kept weights.

Legend: M rows, N out features, K in features; T tokens, H hidden, E experts, A active experts, I expert width.
Tolerances: the oracles dequantise to fp32 and multiply in fp32; the kernels dequantise the same values
exactly (e4m3 / e2m1 codes times powers of two) and accumulate in fp32 in another order: fp32 results agree to
~1e-5 relative, bf16 results to 1 bf16 ulp (`test_triton_kernels.assert_close`).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from conftest import DEVICE, random_ids, run_full, tiny_config

if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton in this process

from helpers import quantize_fp8_block, quantized_bytes
from test_loading import quantised, write_shards
from test_triton_kernels import assert_close

from sparkspec.distributed import ParallelGroup
from sparkspec.loading import CheckpointError
from sparkspec.loading.checkpoint import load_checkpoint
from sparkspec.loading.plan import TensorSource, keep_problem
from sparkspec.loading.quantized import Fp4Linear, Fp8Linear, keep_quantized_
from sparkspec.loading.random_init import random_target_tensors
from sparkspec.ops import moe
from sparkspec.ops.formats import Quantized, dequant_fp4
from sparkspec.ops.quant import fp8_block_linear

triton_quant = pytest.importorskip("sparkspec.ops.triton_kernels.quant")
triton_moe = pytest.importorskip("sparkspec.ops.triton_kernels.moe")

LIMIT = 1.5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_weight(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] e4m3 codes with fp32 power-of-two scales per 128x128 block, varied per block."""
    w = torch.randn(N, K, generator=_gen(seed)) * torch.rand(N, 1, generator=_gen(seed + 1)) * 3
    q, s = quantize_fp8_block(w)
    return q.to(DEVICE), s.to(DEVICE)


def fp4_stack(E: int, rows: int, K: int, seed: int) -> Quantized:
    """Random e2m1 codes [E, rows, K/2] and e8m0 exponents [E, rows, ceil(K/32)] around 2^-2 (K may be ragged)."""
    g = _gen(seed)
    codes = torch.randint(0, 256, (E, rows, K // 2), generator=g, dtype=torch.uint8)
    exps = torch.randint(122, 128, (E, rows, -(-K // 32)), generator=g, dtype=torch.uint8)
    return Quantized(codes.to(DEVICE), exps.to(DEVICE))


# ---------------------------------------------------------------- FP8 linear

FP8_SHAPES = [(1, 200, 300), (3, 128, 128), (5, 130, 260), (40, 72, 136)]  # (M, N, K): ragged blocks, few/many rows


@pytest.mark.parametrize("M,N,K", FP8_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_linear_triton_matches_dequantise_then_matmul(M, N, K, dtype):
    w, s = fp8_weight(N, K, seed=M + N)
    x = torch.randn(M, K, generator=_gen(K)).to(DEVICE, dtype)
    got = triton_quant.fp8_block_linear_triton(x, w, s)
    assert got.dtype == dtype and got.shape == (M, N)
    assert_close(got, fp8_block_linear(x.float(), w, s))


def test_fp8_linear_native_is_dequantise_then_matmul():
    w, s = fp8_weight(130, 260, seed=0)
    x = torch.randn(2, 3, 260, generator=_gen(1)).to(DEVICE)  # leading dims kept
    from sparkspec.ops.formats import dequant_fp8_block

    want = x @ dequant_fp8_block(w, s).t()
    torch.testing.assert_close(fp8_block_linear(x, w, s), want, rtol=1e-5, atol=1e-5)
    assert fp8_block_linear(x.bfloat16(), w, s).dtype == torch.bfloat16


def test_fp8_linear_wrapper_refuses_bad_scales():
    w, s = fp8_weight(130, 260, seed=0)
    with pytest.raises(ValueError, match="scale must be"):
        triton_quant.fp8_block_linear_triton(torch.zeros(1, 260, device=DEVICE), w, s[:1])


def test_fp8_linear_module_calls_the_op():
    layer = Fp8Linear(260, 130).to(DEVICE)
    layer.weight.data, layer.scale.data = fp8_weight(130, 260, seed=3)
    x = torch.randn(4, 260, generator=_gen(2)).to(DEVICE)
    torch.testing.assert_close(layer(x), fp8_block_linear(x, layer.weight, layer.scale))
    layer.to(torch.bfloat16)  # the storage format survives a dtype cast
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.scale.dtype == torch.float32


# ---------------------------------------------------------------- FP4 grouped MoE


def _routing(T, E, A, routing, seed):
    g = _gen(seed)
    if routing == "topk":  # distinct experts, the last one never picked
        ids = torch.rand(T, E - 1, generator=g).topk(A, dim=-1).indices
    else:  # hash-like repeats
        ids = torch.randint(0, 2, (T, A), generator=g) * 2
    return torch.rand(T, A, generator=g).to(DEVICE), ids.to(DEVICE)


FP4_CASES = [(1, 64, 32, "topk"), (3, 48, 80, "hash"), (40, 96, 48, "topk")]  # (T, H, I): K=48/80 ragged 1x32


@pytest.mark.parametrize("T,H,I,routing", FP4_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp4_moe_triton_matches_dequantise_then_native(T, H, I, routing, dtype):
    E, A = 4, 2
    w13, w2 = fp4_stack(E, 2 * I, H, seed=T), fp4_stack(E, H, I, seed=T + 1)
    x = torch.randn(T, H, generator=_gen(H)).to(DEVICE, dtype)
    weights, ids = _routing(T, E, A, routing, seed=I)
    got = triton_moe.moe_experts_triton(x, w13, w2, weights, ids, LIMIT)
    want = moe.moe_experts(x.float(), w13.dequantize(), w2.dequantize(), weights, ids, LIMIT)
    assert got.dtype == dtype
    assert float(want.abs().max()) > 0.5  # the clamps and the weights leave something to compare
    assert_close(got, want)


def test_fp4_moe_native_dequantises_first():
    w13, w2 = fp4_stack(4, 64, 64, seed=0), fp4_stack(4, 64, 32, seed=1)
    x = torch.randn(5, 64, generator=_gen(0)).to(DEVICE)
    weights, ids = _routing(5, 4, 2, "topk", seed=0)
    assert w13.shape == (4, 64, 64) and w2.shape == (4, 64, 32)
    assert torch.equal(moe.moe_experts(x, w13, w2, weights, ids, LIMIT),
                       moe.moe_experts(x, w13.dequantize(), w2.dequantize(), weights, ids, LIMIT))


def test_fp4_experts_stack_once_as_views():
    """`expert_weights` stacks FP4 experts (codes and scales) and re-points the experts' parameters to views."""
    from sparkspec.models.deepseek_v4 import MoE

    cfg = tiny_config(moe_intermediate_size=32)
    layer = MoE(cfg, 1)
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    for e in layer.experts:
        for name, (out, inn) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            fp4 = Fp4Linear(inn, out)
            fp4.weight.data = torch.randint(0, 256, (out, inn // 2), dtype=torch.uint8)
            fp4.scale.data = torch.randint(120, 130, (out, -(-inn // 32)), dtype=torch.uint8)
            setattr(e, name, fp4)
    before = {n: p.clone() for n, p in layer.experts.named_parameters()}
    w13, w2 = moe.expert_weights(layer)
    assert isinstance(w13, Quantized) and w13.shape == (cfg.n_routed_experts, 2 * I, H) and w2.shape[1:] == (H, I)
    assert moe.expert_weights(layer)[0] is w13  # shared, not stacked again
    e = layer.experts[1]
    assert e.w3.scale.data_ptr() == w13.scale[1, I:].data_ptr() and e.w2.weight.data_ptr() == w2.data[1].data_ptr()
    assert all(torch.equal(p, before[n]) for n, p in layer.experts.named_parameters())
    assert torch.equal(w13.dequantize()[1, :I], dequant_fp4(e.w1.weight, e.w1.scale))
    x = torch.randn(3, H, generator=_gen(4))
    torch.testing.assert_close(e.w1(x), x @ dequant_fp4(e.w1.weight, e.w1.scale).t())  # its own forward


# ---------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def fp8_fp4_checkpoint(tmp_path_factory):
    """The tiny model with FP8 linears (e8m0 scales) and FP4 routed experts, over 3 shards."""
    cfg = tiny_config(moe_intermediate_size=32)  # FP4 scale blocks are 1x32
    raw, _ = quantised(random_target_tensors(cfg, _gen(8)))
    return write_shards(tmp_path_factory.mktemp("fp8_fp4"), raw, cfg)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


KEPT_FP8 = {"attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b", "ffn.shared_experts.w1",
            "ffn.shared_experts.w2", "ffn.shared_experts.w3"}


def test_keep_holds_the_callable_layers_quantised(fp8_fp4_checkpoint):
    ck = load_checkpoint(fp8_fp4_checkpoint, device=DEVICE, dtype=torch.bfloat16, quantization="keep")
    model, cfg = ck.model, ck.config
    kinds = {n.split(".", 2)[2] if ".experts." not in n or "shared" in n else "experts" for n in ck.kept_quantized}
    assert kinds == KEPT_FP8 | {"experts"}
    assert len([n for n in ck.kept_quantized if ".experts." in n and "shared" not in n]) == \
        3 * cfg.n_routed_experts * cfg.num_hidden_layers
    attn = model.layers[1].attn
    assert isinstance(attn.wq_a, Fp8Linear) and attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert isinstance(model.layers[0].ffn.experts[0].w2, Fp4Linear)
    # read through `.weight` by the model: dequantised to the load dtype
    for t in (attn.wo_a.weight, attn.compressor.wkv.weight, model.layers[0].ffn.gate.weight, model.head.weight):
        assert t.dtype == torch.bfloat16
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_keep_gives_the_logits_of_dequantize(fp8_fp4_checkpoint, dtype):
    """Kept layers compute x · dequant(W)ᵀ in fp32 (native ops on a CPU); the dequantised model multiplies the
    same values in `dtype`: equal up to summation order in fp32, up to bf16 rounding of the layer outputs in bf16."""
    kept = load_checkpoint(fp8_fp4_checkpoint, device=DEVICE, dtype=dtype, quantization="keep").model
    plain = load_checkpoint(fp8_fp4_checkpoint, device=DEVICE, dtype=dtype, quantization="dequantize").model
    ids = random_ids(40, kept.cfg.vocab_size, seed=5)
    with torch.no_grad():
        a, b = run_full(kept, ids).logits, run_full(plain, ids).logits
    assert float(b.std()) > 0.1
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    else:
        assert float((a - b).abs().max()) <= 0.05 * float(b.abs().max())


def test_keep_uses_the_quantised_size(fp8_fp4_checkpoint):
    kept = load_checkpoint(fp8_fp4_checkpoint, device=DEVICE, dtype=torch.bfloat16, quantization="keep").model
    plain = load_checkpoint(fp8_fp4_checkpoint, device=DEVICE, dtype=torch.bfloat16, quantization="dequantize").model
    expected = 0
    for m in kept.modules():
        if isinstance(m, Fp8Linear):
            expected += m.out_features * m.in_features + 4 * m.scale.numel()  # 1 byte a weight, fp32 scales
        elif isinstance(m, Fp4Linear):
            expected += m.out_features * m.in_features // 2 + m.out_features * -(-m.in_features // 32)
    assert quantized_bytes(kept) == expected
    assert param_bytes(kept) < param_bytes(plain)
    assert param_bytes(plain) - param_bytes(kept) > 0.3 * param_bytes(plain)


def test_auto_dequantises_on_cpu_and_plain_checkpoints_load_as_before(fp8_fp4_checkpoint, tiny_checkpoint):
    from test_loading import assert_same_model

    if DEVICE.type == "cpu":
        assert load_checkpoint(fp8_fp4_checkpoint, device=DEVICE).kept_quantized == ()
    for dtype in (torch.float32, torch.bfloat16):
        kept = load_checkpoint(tiny_checkpoint, device=DEVICE, dtype=dtype, quantization="keep")
        assert kept.kept_quantized == ()
        assert_same_model(kept.model, load_checkpoint(tiny_checkpoint, device=DEVICE, dtype=dtype,
                                                      quantization="dequantize").model)
    with pytest.raises(ValueError, match="quantization = 'fp8'"):
        load_checkpoint(tiny_checkpoint, quantization="fp8")


def test_kept_model_generates_the_dequantised_models_greedy_tokens(fp8_fp4_checkpoint):
    """Through the engine (fp32, prefill + decode + n-gram verify steps): same greedy tokens."""
    from sparkspec.engine.llm import LLM
    from sparkspec.sampling_params import SamplingParams

    prompts = [random_ids(n, 96, seed=n).tolist() for n in (5, 17)]
    prompts[1] = prompts[1][:6] * 3  # repeats: the n-gram drafter proposes, the target verifies
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    tokens = {}
    for how in ("keep", "dequantize"):
        ck = load_checkpoint(fp8_fp4_checkpoint, device=DEVICE, dtype=torch.float32, quantization=how)
        llm = LLM(ck, speculative="ngram", spec_budget="fixed", max_num_seqs=2)
        tokens[how] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens["keep"] == tokens["dequantize"] and all(len(t) == 16 for t in tokens["keep"])


# ---------------------------------------------------------------- tensor-parallel slices


def _src(quant: str, shape, cut) -> TensorSource:
    if quant == "fp8":
        scale = TensorSource(None, "s", torch.float32, (-(-shape[0] // 128), -(-shape[1] // 128)))
        return TensorSource(None, "w", torch.float8_e4m3fn, shape, scale=scale, cut=cut)
    scale = TensorSource(None, "s", torch.uint8, (shape[0], -(-shape[1] // 16)))
    return TensorSource(None, "w", torch.int8, shape, scale=scale, cut=cut)  # packed: stored [out, in/2]


@pytest.mark.parametrize("quant,shape,cut,ok", [
    ("fp8", (256, 384), None, True),
    ("fp8", (256, 384), (0, 128, 256), True),
    ("fp8", (256, 384), (1, 0, 128), True),
    ("fp8", (256, 300), (1, 256, 300), True),  # the ragged last block, to the end
    ("fp8", (256, 384), (0, 64, 128), False),
    ("fp8", (256, 384), (1, 0, 192), False),
    ("fp4", (64, 32), (0, 8, 16), True),  # rows: one scale row each
    ("fp4", (64, 32), (1, 32, 64), True),  # packed [64, 32] holds 64 columns
    ("fp4", (64, 32), (1, 16, 32), False),
])
def test_keep_problem_is_whole_scale_blocks(quant, shape, cut, ok):
    problem = keep_problem(_src(quant, shape, cut))
    assert (problem is None) == ok, problem


def aligned_config():
    """Tiny, but with tensor-parallel cuts on 128-blocks at 2 ranks: wq_b rows 4·64 -> 128 a rank, wo_b columns
    2·128 -> 128, shared expert width 256 -> 128; routed expert width 64 -> 32 (FP4 1x32 blocks)."""
    return tiny_config(head_dim=64, qk_rope_head_dim=16, o_lora_rank=128, moe_intermediate_size=64,
                       n_shared_experts=4, index_head_dim=16)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_rank_slices_of_kept_weights_are_the_whole_model_cut(tmp_path, expert_parallel):
    cfg = aligned_config()
    raw, _ = quantised(random_target_tensors(cfg, _gen(3)))
    path = write_shards(tmp_path, raw, cfg)
    whole = dict(load_checkpoint(path, device=DEVICE, quantization="keep").model.named_parameters())
    for rank in range(2):
        ck = load_checkpoint(path, device=DEVICE, quantization="keep", parallel=ParallelGroup(rank, 2),
                             expert_parallel=expert_parallel)
        attn, ffn = ck.model.layers[0].attn, ck.model.layers[0].ffn
        assert isinstance(attn.wq_b, Fp8Linear) and isinstance(attn.wo_b, Fp8Linear)
        assert isinstance(ffn.shared_experts.w2, Fp8Linear) and isinstance(ffn.experts[0].w2, Fp4Linear)
        got = dict(ck.model.named_parameters())
        compared = set()
        for name, cut in ck.model.shard_cuts.items():
            if not name.endswith(".weight") or got[name].dtype not in (torch.float8_e4m3fn, torch.uint8):
                continue
            scale_name = name.removesuffix("weight") + "scale"
            want_w, want_s = whole[cut.source], whole[cut.source.removesuffix("weight") + "scale"]
            if cut.dim is not None:
                fp4 = got[name].dtype == torch.uint8
                pack, block = (2, 32) if fp4 and cut.dim == 1 else (1, 1) if fp4 else (1, 128)
                want_w = want_w.narrow(cut.dim, cut.start // pack, (cut.stop - cut.start) // pack)
                want_s = want_s.narrow(cut.dim, cut.start // block, -(-(cut.stop - cut.start) // block))
            assert torch.equal(got[name].view(torch.uint8), want_w.view(torch.uint8)), name
            assert torch.equal(got[scale_name], want_s), scale_name
            base = re.sub(r"^layers\.\d+\.|\.\d+(?=\.)|\.weight$", "", name)
            compared.add(base + ("" if cut.dim is None else " cut"))
        experts = {f"ffn.experts.{w}" + ("" if expert_parallel else " cut") for w in ("w1", "w2", "w3")}
        assert compared == {"attn.wq_b cut", "attn.wo_b cut", "ffn.shared_experts.w1 cut", "ffn.shared_experts.w2 cut",
                            "ffn.shared_experts.w3 cut"} | experts


def test_misaligned_rank_slices_are_refused_by_keep_and_dequantised_by_auto(fp8_fp4_checkpoint):
    """The tiny config's wq_b rows (4 heads · 16) cut at 32 a rank: off the 128-blocks."""
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attn\.wq_b\.weight'.*128-wide scale blocks"):
        load_checkpoint(fp8_fp4_checkpoint, device=DEVICE, quantization="keep", parallel=ParallelGroup(0, 2))
    from sparkspec.loading.checkpoint import _shard_plan
    from sparkspec.loading.meta import meta_model
    from sparkspec.loading.plan import plan_tensors

    cfg = tiny_config(moe_intermediate_size=32)
    model = meta_model(cfg, torch.bfloat16)
    _, plan = _shard_plan(model, plan_tensors(fp8_fp4_checkpoint), ParallelGroup(1, 2), False)
    kept = keep_quantized_(model, plan, strict=False)  # what "auto" does on an accelerator
    assert "layers.0.attn.wq_a" in kept and "layers.0.attn.wq_b" not in kept  # wq_a is not cut
    # expert width 32 -> 16 a rank: w2's columns are off the 1x32 blocks, so no routed expert of the layer is kept
    assert not any(".experts." in n for n in kept)
    assert not isinstance(model.layers[0].ffn.experts[0].w1, Fp4Linear)
