"""Native (PyTorch) vs Triton time per op at DeepSeek-V4-Flash-like shapes, on the current GPU.

    python -m sparkspec.bench.kernels [--json kernels.json] [--sweep] [--only sparse_attention,mhc_pre]

Prints a table (median ms from `triton.testing.do_bench`, speed-up, relative error of the Triton result
against the native op on fp32-upcast inputs) and writes the rows as JSON. `--sweep` also times the
sparse-attention tile configurations so the wrapper's default can be chosen from numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch

# Flash: 64 heads, latent 512, window 128, top-k 512, hidden 4096, 4 hc streams, 20 Sinkhorn iterations
HEADS, HEAD_DIM, WINDOW, TOPK, HIDDEN, HC, SINKHORN = 64, 512, 128, 512, 4096, 4, 20


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def _time(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _row(op: str, shape: str, native: Callable, triton_fn: Callable, check: Callable[[], float]) -> dict:
    row = {"op": op, "shape": shape}
    try:
        row["rel_err"] = check()
        row["native_ms"] = _time(native)
        row["triton_ms"] = _time(triton_fn)
        row["speedup"] = row["native_ms"] / row["triton_ms"]
    except Exception as exc:  # keep the other rows; report what broke
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    torch.cuda.empty_cache()
    return row


def _attention_case(T: int, width: int, pad_frac: float, pool: int, dev, gen):
    q = torch.randn(T, HEADS, HEAD_DIM, device=dev, generator=gen).bfloat16()
    kv = torch.randn(pool, HEAD_DIM, device=dev, generator=gen).bfloat16()
    idx = torch.randint(0, pool, (T, width), device=dev, generator=gen)
    idx[torch.rand(T, width, device=dev, generator=gen) < pad_frac] = -1
    sink = torch.randn(HEADS, device=dev, generator=gen)
    return q, kv, idx, sink


ATTENTION_SHAPES = [  # (label, T, width, padding fraction)
    ("decode T=64 csa W=128+512", 64, WINDOW + TOPK, 0.0),
    ("prefill T=1024 csa W=128+512", 1024, WINDOW + TOPK, 0.1),
    ("prefill T=1024 swa W=128", 1024, WINDOW, 0.0),
    ("dspark 64x5 W=128+5", 320, WINDOW + 5, 0.0),
]


def bench_sparse_attention(dev, gen) -> list[dict]:
    from sparkspec.ops.attention import sparse_attention as native
    from sparkspec.ops.triton_kernels.attention import sparse_attention as tri

    rows = []
    for label, T, width, pad in ATTENTION_SHAPES:
        q, kv, idx, sink = _attention_case(T, width, pad, 65536, dev, gen)
        scale = HEAD_DIM**-0.5
        rows.append(_row(
            "sparse_attention", f"{label} h={HEADS} D={HEAD_DIM}",
            lambda: native(q, kv, idx, sink, scale), lambda: tri(q, kv, idx, sink, scale),
            lambda: _rel_err(tri(q, kv, idx, sink, scale), native(q.float(), kv.float(), idx, sink, scale)),
        ))
    return rows


SWEEP = [(16, 16, 4, 1), (16, 32, 4, 1), (16, 32, 8, 1), (16, 64, 8, 1), (32, 32, 8, 1), (16, 32, 8, 2)]


def sweep_sparse_attention(dev, gen) -> list[dict]:
    from sparkspec.ops.triton_kernels.attention import AttentionConfig
    from sparkspec.ops.triton_kernels.attention import sparse_attention as tri

    rows = []
    for label, T, width, pad in ATTENTION_SHAPES[:2]:
        q, kv, idx, sink = _attention_case(T, width, pad, 65536, dev, gen)
        ref = tri(q, kv, idx, sink, 0.04, AttentionConfig(16, 16, 4, 1)).float()
        for bh, bn, warps, stages in SWEEP:
            cfg = AttentionConfig(bh, bn, warps, stages)
            row = {"op": "sparse_attention[sweep]", "shape": label, "config": f"H{bh} N{bn} w{warps} s{stages}"}
            try:
                row["rel_err"] = _rel_err(tri(q, kv, idx, sink, 0.04, cfg), ref)
                row["triton_ms"] = _time(lambda cfg=cfg: tri(q, kv, idx, sink, 0.04, cfg))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append(row)
    return rows


def bench_indices(dev, gen) -> list[dict]:
    from sparkspec.ops import indices as ref
    from sparkspec.ops.triton_kernels import indices as tri

    rows = []
    for label, lens, ctx in [("decode 64 seqs", [1] * 64, 4096), ("prefill 4x512", [512] * 4, 2048)]:
        R = len(lens)
        starts = [ctx + 37 * r for r in range(R)]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(dev)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)
        lo = torch.tensor([max(0, s - WINDOW + 1) for s in starts], device=dev)
        num_raw = torch.tensor([s + n - max(0, s - WINDOW + 1) for s, n in zip(starts, lens)], device=dev)
        offsets = torch.arange(R, device=dev) * 10_000
        topk = torch.randint(-1, (ctx + 512) // 4, (positions.numel(), TOPK), device=dev, generator=gen)
        args = (positions, cu, lo, num_raw, offsets, WINDOW, 4, topk)
        rows.append(_row(
            "ragged_swa_compressed_indices", f"{label} csa W=128+512",
            lambda: ref._ragged_swa_compressed_indices_native(*args), lambda: tri.ragged_swa_compressed_indices(*args),
            lambda: float(not torch.equal(tri.ragged_swa_compressed_indices(*args),
                                          ref._ragged_swa_compressed_indices_native(*args))),
        ))
    num_ctx = torch.randint(0, 8192, (64,), device=dev, generator=gen)
    offsets = torch.arange(64, device=dev) * 10_000
    args = (num_ctx, offsets, 5, WINDOW)
    rows.append(_row(
        "ragged_dspark_block_indices", "64 seqs x 5 block rows W=128+5",
        lambda: ref._ragged_dspark_block_indices_native(*args), lambda: tri.ragged_dspark_block_indices(*args),
        lambda: float(not torch.equal(tri.ragged_dspark_block_indices(*args),
                                      ref._ragged_dspark_block_indices_native(*args))),
    ))
    return rows


def bench_mhc(dev, gen) -> list[dict]:
    from sparkspec.ops import mhc as ref
    from sparkspec.ops.triton_kernels import mhc as tri

    rows = []
    n, H = HC, HIDDEN
    M = (2 + n) * n
    for T in (64, 2048):
        x = torch.randn(T, n, H, device=dev, generator=gen).bfloat16()
        fn = torch.randn(M, n * H, device=dev, generator=gen) * 0.01
        base = torch.randn(M, device=dev, generator=gen) * 0.1
        scale = torch.rand(3, device=dev, generator=gen) + 0.5
        pre_args = (fn, scale, base, 1e-6, 1e-6, SINKHORN)
        rows.append(_row(
            "mhc_pre", f"T={T} n={n} H={H} iters={SINKHORN}",
            lambda: ref.mhc_pre(x, *pre_args), lambda: tri.mhc_pre(x, *pre_args),
            lambda: max(_rel_err(a, b) for a, b in zip(tri.mhc_pre(x, *pre_args), ref.mhc_pre(x.float(), *pre_args))),
        ))
        y = torch.randn(T, H, device=dev, generator=gen).bfloat16()
        _, post, comb = ref.mhc_pre(x, *pre_args)
        rows.append(_row(
            "mhc_post", f"T={T} n={n} H={H}",
            lambda: ref.mhc_post(y, x, post, comb), lambda: tri.mhc_post(y, x, post, comb),
            lambda: _rel_err(tri.mhc_post(y, x, post, comb), ref.mhc_post(y.float(), x.float(), post, comb)),
        ))
        hfn = torch.randn(n, n * H, device=dev, generator=gen) * 0.01
        head_args = (hfn, torch.rand(1, device=dev, generator=gen), base[:n].contiguous(), 1e-6, 1e-6)
        rows.append(_row(
            "hc_head", f"T={T} n={n} H={H}",
            lambda: ref.hc_head(x, *head_args), lambda: tri.hc_head(x, *head_args),
            lambda: _rel_err(tri.hc_head(x, *head_args), ref.hc_head(x.float(), *head_args)),
        ))
    return rows


MOE_EXPERTS, MOE_TOPK, MOE_INTER = 256, 6, 2048  # Flash routed experts (FP4 e2m1, e8m0 per 32 values)


def bench_moe_fp4(dev, gen) -> list[dict]:
    """FP4 routed experts (`moe_fp4`) against the native on the dequantised bf16 stacks (`torch._grouped_mm`);
    rel err against that native (bf16 rounding level)."""
    from sparkspec.ops import moe
    from sparkspec.ops.formats import Quantized
    from sparkspec.ops.triton_kernels.moe_fp4 import moe_experts_fp4

    E, A, H, I = MOE_EXPERTS, MOE_TOPK, HIDDEN, MOE_INTER

    def stack(R, K):  # random codes, scales around 2^-6 (~1/sqrt(K))
        codes = torch.randint(0, 256, (E, R, K // 2), device=dev, generator=gen, dtype=torch.uint8)
        return Quantized(codes, torch.randint(119, 124, (E, R, K // 32), device=dev, generator=gen).to(torch.uint8))

    w13, w2 = stack(2 * I, H), stack(H, I)
    w13b, w2b = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    rows = []
    for T in (1, 64, 2048):
        x = torch.randn(T, H, device=dev, generator=gen).bfloat16()
        ids = torch.rand(T, E, device=dev, generator=gen).topk(A, dim=-1).indices
        w = torch.rand(T, A, device=dev, generator=gen) / A
        rows.append(_row(
            "moe_experts fp4", f"T={T} E={E} top-{A} H={H} I={I}",
            lambda: moe.moe_experts(x, w13b, w2b, w, ids, 10.0), lambda: moe_experts_fp4(x, w13, w2, w, ids, 10.0),
            lambda: _rel_err(moe_experts_fp4(x, w13, w2, w, ids, 10.0), moe.moe_experts(x, w13b, w2b, w, ids, 10.0)),
        ))
    return rows


def _print_table(rows: list[dict]) -> None:
    print(f"{'op':32} {'shape':46} {'native ms':>10} {'triton ms':>10} {'speedup':>8} {'rel err':>9}")
    for r in rows:
        shape = r["shape"] + (f" [{r['config']}]" if "config" in r else "")
        if "error" in r:
            print(f"{r['op']:32} {shape:46} ERROR {r['error']}")
            continue
        nat = f"{r['native_ms']:10.4f}" if "native_ms" in r else f"{'-':>10}"
        sp = f"{r['speedup']:7.2f}x" if "speedup" in r else f"{'-':>8}"
        print(f"{r['op']:32} {shape:46} {nat} {r['triton_ms']:10.4f} {sp} {r['rel_err']:9.2e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="kernels_bench.json", help="where to write the rows")
    ap.add_argument("--sweep", action="store_true", help="also time sparse-attention tile configurations")
    ap.add_argument("--only", default="", help="comma list among sparse_attention,indices,mhc,moe_fp4")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels bench: no GPU here (the Triton kernels are timed on cuda/rocm devices only)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    groups = {"sparse_attention": bench_sparse_attention, "indices": bench_indices, "mhc": bench_mhc,
              "moe_fp4": bench_moe_fp4}
    chosen = [g for g in args.only.split(",") if g] or list(groups)
    rows: list[dict] = []
    for name in chosen:
        rows += groups[name](dev, gen)
    if args.sweep:
        rows += sweep_sparse_attention(dev, gen)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"# {meta}")
    _print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
