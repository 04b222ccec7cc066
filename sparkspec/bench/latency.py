"""`sparkspec bench latency`: milliseconds per decode step at fixed batch sizes, against the memory-bandwidth
floor and (optionally) transformers' `DeepseekV4ForCausalLM.generate` on the same weights, in one process.

Per batch size B: B requests of `input_len` random prompt tokens are prefilled, then `output_len` tokens are
decoded; the decode steps are timed (wall clock, the device synchronised before and after). The floor of one
step is the bytes it must read, active weights (every dense weight, the shared experts, and the routed experts
that B tokens are expected to hit) plus the KV rows each query reads, divided by the device copy bandwidth
measured in the same run. The ratio to it says how far the step is from memory-bound. With speculation
(`--spec`, on a checkpoint with drafter weights) a row also gives τ and the split of one verify step
(`split_step_ms`, the engine's step over the requests' pools, median of a few) into verifying k drafts
(`verify_ms`) and drafting the next k (`draft_ms` = split_step_ms - verify_ms; `draft_share` = draft / verify).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.distributed as dist

from sparkspec.bench.common import sync, table_head, table_row
from sparkspec.config import CSA, ModelConfig
from sparkspec.engine.config import BATCH_INVARIANT_HELP
from sparkspec.spec_decode.methods import SPEC_METHODS


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def step_bytes(model, batch: int, context: int, rows_per_request: int = 1, uniform: bool = False) -> int:
    """Bytes a decode step of `batch` requests of `rows_per_request` rows each (1 + k when verifying k drafts)
    at `context` positions must read at least, on this rank: its dense weights and shared experts, the routed
    experts it holds that the step's tokens are expected to hit (at random, or with `uniform` routing), and the
    KV rows its queries read (the latent is replicated: every rank reads all of them)."""
    cfg: ModelConfig = model.cfg
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name or name == "embed.weight":
            continue
        total += p.numel() * p.element_size()
    E, A, tokens = cfg.n_routed_experts, cfg.num_experts_per_tok, batch * rows_per_request
    hit = min(1.0, tokens * A / E) if uniform else 1 - (1 - A / E) ** tokens  # share of experts a layer reads
    experts = model.layers[0].ffn.experts  # this rank's: all of them (width slices) or E / W whole ones
    expert = sum(p.numel() * p.element_size() for p in experts[0].parameters())
    total += int(cfg.num_hidden_layers * hit * len(experts) * expert)
    elt = model.embed.weight.element_size()  # the attn pool's dtype (`KVCache`); the first parameter is fp32 mHC
    kv = 0
    for layer in range(cfg.num_hidden_layers):
        rows = min(context, cfg.sliding_window)
        ratio = cfg.compress_ratio(layer)
        if ratio > 1:
            entries = context // ratio
            rows += min(entries, cfg.index_topk) if cfg.layer_types[layer] == CSA else entries
            if cfg.layer_types[layer] == CSA:
                kv += entries * cfg.index_head_dim * 4  # the indexer scores every entry
        kv += rows * cfg.head_dim * elt
    return total + batch * kv


def engine_step_ms(model, batch: int, input_len: int, output_len: int, spec: str = "none", num_spec_tokens=None,
                   drafter_tensors=None, seed: int = 0, profile: bool = False, enforce_eager: bool = False,
                   out: dict | None = None, proposer=None, probe=None, max_num_batched_tokens: int | None = None
                   ) -> float | dict:
    """Decode milliseconds per step of `LLMEngine` (prefill excluded); with `profile`, the profile of a few
    decode steps instead. `out` receives tok/s and, with speculation, τ and the draft / verify split.
    `proposer`: a ready drafter (random weights) instead of one built from `drafter_tensors`; `probe`: a
    `RoutingProbe`, entered before the engine is built, whose load over the timed steps goes to `out`.
    Every rank of a tensor-parallel run calls this with the same arguments: the engines then take the same
    steps (same requests, seeds and shapes), so their collectives meet."""
    import contextlib

    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.sampling_params import SamplingParams

    device = next(model.parameters()).device
    cfg = EngineConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=max_num_batched_tokens or
                       max(batch * input_len, 64), max_model_len=input_len + output_len + 16, speculative=spec,
                       num_spec_tokens=num_spec_tokens, spec_budget="fixed", enforce_eager=enforce_eager)
    with probe if probe is not None else contextlib.nullcontext():
        eng = LLMEngine(model, None, cfg, drafter_tensors or {}, proposer=proposer)
        g = torch.Generator().manual_seed(seed)
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, seed=seed)
        for _ in range(batch):
            eng.add_request(torch.randint(2, model.cfg.vocab_size, (input_len,), generator=g).tolist(), params)
        while any(not s.output_ids for s in eng.requests.values()):
            eng.step()  # prefill (and warm-up)
        for _ in range(2):
            eng.step()
        if profile:
            return profile_steps(eng, device)
        st = eng.stats
        tokens0, spec0, acc0 = st.num_generation_tokens, st.num_spec_steps, st.num_accepted
        preempted0 = eng.scheduler.num_preemptions
        before = probe.snapshot() if probe is not None else None
        sync(device)
        t0, steps = time.perf_counter(), 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        sync(device)
        seconds = time.perf_counter() - t0
        if out is not None:
            out["tok_s"] = (st.num_generation_tokens - tokens0) / seconds
            # a preempted request recomputes its prompt inside the timed steps: such a row is not a decode time
            out["preemptions"] = eng.scheduler.num_preemptions - preempted0
            out["kv_blocks"] = eng.kv_plan.num_blocks
            if probe is not None:
                out["load"] = probe.load(before, probe.snapshot())
            if eng.spec is not None and st.num_spec_steps > spec0:
                n = st.num_spec_steps - spec0
                out["tau"] = (st.num_accepted - acc0 + n) / n
                out |= step_split(eng, batch, input_len)
    return 1000 * seconds / max(steps, 1)


def step_split(eng, batch: int, context_len: int, repeats: int = 5) -> dict:
    """One decode step of `batch` requests cut in two: verifying k drafts (the target forward, the rejection
    sampler and the copy back), and drafting the next k (observe + propose), by difference: the whole step
    (`split_step_ms`) minus the same step without drafting (`verify_ms`, at most the whole step: noise can make the
    median without drafting the larger). The two parts add up to the step. Runs on the engine's pools once its
    requests are done."""
    spec, runner = eng.spec, eng.runner
    k = spec.num_spec_tokens
    items = spec.probe_requests(runner, batch, context_len)
    drafts = [[2] * k for _ in items]
    verify = spec.time_step(runner, items, drafts, 0, repeats)
    full = spec.time_step(runner, items, drafts, k if spec.proposer.on_device else 0, repeats)
    verify = min(verify, full)
    return {"split_step_ms": 1000 * full, "verify_ms": 1000 * verify, "draft_ms": 1000 * (full - verify),
            "draft_share": (full - verify) / verify}


# Kernel groups of a decode step, from kernel names alone (CUDA graphs leave no host scopes to attribute by):
# the first group with a key that is a substring of the lowercased name wins ("a&b": both are), so the order
# matters (FP8 GEMMs before generic GEMMs, mHC before norms). Names cannot tell which module launched a generic
# kernel: the shared expert's FP8 GEMMs count as "fp8_linears" (its group is the swiglu glue); int64-key sorts
# and top-k count as "moe_routing" (sort_by_expert, moe_route); float sorts (the indexer's stable sort,
# sampling) land in "other"; "dense_gemm" is cuBLAS in bf16 / fp32 (the lm head, the MoE gate, fp32
# projections). `top_other` lists what the table missed.
KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fp8_linears", ("_fp8_linear", "_sum_splits", "scaled_mm", "e4m3", "f8f8")),
    ("mhc", ("_mix_partial", "_mhc_", "_hc_head")),
    ("attention", ("_sparse_attention", "_indexer_", "_topk_select", "_emit_", "_store_states", "_ragged",
                   "_compress")),
    ("moe_routing", ("_moe_route", "_moe_gate", "_moe_sort", "topk", "sigmoid", "softplus", "searchsorted",
                     "bincount", "histogram", "radixsort&long, long")),
    ("fp4_experts", ("_moe_", "_sum_slots", "grouped_mm", "grouped_gemm", "_fp4")),
    ("shared_expert", ("silu", "swiglu")),
    ("norms_rope", ("_norm_rope", "rms_norm", "rmsnorm", "rsqrt", "_rope")),
    ("sampling", ("argmax", "distribution_", "exponential", "multinomial", "softmax", "_sample", "gumbel")),
    ("dense_gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")),
)
GROUP_ORDER = tuple(g for g, _ in KERNEL_GROUPS) + ("other",)


def kernel_group(name: str) -> str:
    """The group of a kernel name (see KERNEL_GROUPS), "other" when no key matches."""
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(all(part in low for part in k.split("&")) for k in keys):
            return group
    return "other"


def group_kernel_times(kernels: list[tuple[str, float]], num_steps: int, num_top: int = 8) -> dict:
    """(kernel name, device µs) of every kernel of `num_steps` steps -> {"groups": {group: {"ms": device ms per
    step, "kernels": launches per step, "share": of the device time}} in GROUP_ORDER (empty groups too),
    "top_other": [(name[:80], ms per step)] of the largest unmatched kernels}."""
    ms = dict.fromkeys(GROUP_ORDER, 0.0)
    count = dict.fromkeys(GROUP_ORDER, 0)
    other: dict[str, float] = {}
    for name, us in kernels:
        g = kernel_group(name)
        ms[g] += us / 1000
        count[g] += 1
        if g == "other":
            other[name] = other.get(name, 0.0) + us / 1000
    total = sum(ms.values()) or 1.0
    groups = {g: {"ms": round(ms[g] / num_steps, 4), "kernels": round(count[g] / num_steps, 2),
                  "share": round(ms[g] / total, 3)} for g in GROUP_ORDER}
    top = sorted(other.items(), key=lambda kv: -kv[1])[:num_top]
    return {"groups": groups, "top_other": [(n[:80], round(t / num_steps, 4)) for n, t in top]}


def format_groups(prof: dict) -> str:
    """The kernel-group table of `group_kernel_times` as markdown, then the largest unmatched kernels."""
    lines = ["| group | device ms / step | kernels / step | share |", "|---|---|---|---|"]
    for g, v in prof["groups"].items():
        lines.append(f"| {g} | {v['ms']:.4f} | {v['kernels']:g} | {100 * v['share']:.1f} % |")
    total_ms = sum(v["ms"] for v in prof["groups"].values())
    total_k = sum(v["kernels"] for v in prof["groups"].values())
    lines.append(f"| total | {total_ms:.4f} | {total_k:g} | 100 % |")
    lines += [f"  other: {t:.4f} ms  {n}" for n, t in prof["top_other"]]
    return "\n".join(lines)


def _device_us(e) -> float:
    return getattr(e, "device_time", 0) or getattr(e, "cuda_time", 0) or 0.0


def profile_steps(eng, device: torch.device, num_steps: int = 8) -> dict:
    """Kernel launches, host syncs, device busy time and device time per kernel group per decode step (torch
    profiler)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(num_steps):
            eng.step()
        sync(device)
    wall = time.perf_counter() - t0
    events = prof.events()
    kernels = [e for e in events if getattr(e.device_type, "name", "") in ("CUDA", "HIP", "XPU")]
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(1 for e in events if "Synchronize" in e.name)
    busy = sum(_device_us(e) for e in kernels) / 1e6
    out = {"kernels_per_step": len(kernels) / num_steps, "launches_per_step": launches / num_steps,
           "syncs_per_step": syncs / num_steps,
           "gpu_busy_fraction": round(busy / wall, 3) if wall else 0.0}
    print(f"profile over {num_steps} decode steps: {out}", flush=True)
    out["kernel_groups"] = group_kernel_times([(e.name, _device_us(e)) for e in kernels], num_steps)
    print(format_groups(out["kernel_groups"]), flush=True)
    return out


def truncated(cfg: ModelConfig, num_layers: int | None) -> ModelConfig:
    """The first `num_layers` target layers of `cfg` (the same layer shapes, fewer of them: what fits when the
    whole model does not); DSpark taps move with the last layers. None: `cfg` itself."""
    if num_layers is None or num_layers == cfg.num_hidden_layers:
        return cfg
    if not 1 <= num_layers <= cfg.num_hidden_layers:
        raise ValueError(f"--num-layers {num_layers}: expected 1..{cfg.num_hidden_layers}")
    drop = cfg.num_hidden_layers - num_layers
    taps = None if cfg.dspark_target_layer_ids is None else sorted({max(i - drop, 0)
                                                                    for i in cfg.dspark_target_layer_ids})
    return dataclasses.replace(cfg, num_hidden_layers=num_layers, layer_types=cfg.layer_types[:num_layers],
                               mlp_layer_types=cfg.mlp_layer_types[:num_layers], dspark_target_layer_ids=taps)


def run(args) -> list[dict]:
    """The table on this process (rank 0); with --tensor-parallel-size N, ranks 1.. run `bench_rank` in their
    own processes (one per device) and rank 0 gathers their rows."""
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: expected a positive integer")
    if getattr(args, "batch_invariant_cost", False) and args.batch_invariant:
        raise ValueError("--batch-invariant-cost times both modes itself: drop --batch-invariant")
    if args.tensor_parallel_size == 1:
        return bench_rank(None, args)
    if args.compare_transformers:
        raise ValueError("--compare-transformers runs in one process: drop --tensor-parallel-size")
    from sparkspec.engine.lockstep import finish, launch, rank_device

    pg = launch(args.tensor_parallel_size, bench_rank, (args,), rank_device(0, args.device))
    try:
        return bench_rank(pg, args)
    finally:
        finish(None)


def build_model(args, cfg: ModelConfig | None, device: torch.device, dtype: torch.dtype, pg):
    """-> (model, drafter_tensors, proposer factory or None, transformers model or None) for this rank."""
    if args.model is not None:
        from sparkspec.loading.checkpoint import load_checkpoint

        ckpt = load_checkpoint(args.model, device=str(device), dtype=args.dtype, progress=pg is None or pg.rank == 0,
                               parallel=pg, expert_parallel=args.enable_expert_parallel,
                               quantization=args.quantization)
        return ckpt.model, ckpt.drafter_tensors, None, None
    if args.compare_transformers:
        from sparkspec.bench.hf_compare import transformers_pair

        try:
            hf, model = transformers_pair(cfg, device, dtype)
            return model, {}, None, hf
        except ImportError:
            print("transformers is not installed: skipping the comparison")
            args.compare_transformers = False
    from sparkspec.loading.random_model import random_model

    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    if args.spec not in ("none", "ngram", "dspark"):
        raise ValueError(f"--spec {args.spec} with random weights: only dspark has a random drafter")
    model, drafter = random_model(cfg, device, dtype, pg, args.enable_expert_parallel, seed=0,
                                  drafter="dspark" if args.spec == "dspark" else None,
                                  max_bytes=int(0.85 * free) if free else None, quantization=args.quantization)
    factory = None
    if drafter is not None:
        from sparkspec.spec_decode.dspark import DSparkProposer

        k = args.num_spec_tokens or cfg.dspark_block_size

        def factory():  # a fresh one per engine
            return DSparkProposer(model, drafter, k)
    return model, {}, factory, None


def bench_rank(pg, args) -> list[dict]:
    """Build this rank's model, time every batch size, and (rank 0) print and write the table; the other
    ranks send their rows to rank 0."""
    import gc

    from sparkspec.bench.routing import RoutingProbe
    from sparkspec.ops.batch_invariant import set_batch_invariant

    set_batch_invariant(getattr(args, "batch_invariant", False))  # process-wide, before any engine is built
    from sparkspec.engine.lockstep import rank_device

    rank, world = (pg.rank, pg.world_size) if pg is not None else (0, 1)
    device = rank_device(rank, args.device) if pg is not None else \
        torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)  # the probe requests of the draft / verify split draw from it: the same on every rank
    cfg = None
    if args.model is None:
        cfg = ModelConfig.from_file(args.preset) if args.preset.endswith(".json") else ModelConfig.preset(args.preset)
        cfg = truncated(cfg, args.num_layers)
    t0 = time.perf_counter()
    model, drafter_tensors, proposer, hf = build_model(args, cfg, device, dtype, pg)
    build_s = time.perf_counter() - t0
    bandwidth = copy_bandwidth(device) if device.type != "cpu" else copy_bandwidth(device, 1 << 26)
    num_ep_ranks = world if args.enable_expert_parallel else 1
    k = 0 if args.spec == "none" else (args.num_spec_tokens or (model.cfg.dspark_block_size if args.spec == "dspark"
                                                                 else 1))

    def release() -> None:  # the last engine (KV pools, graphs) goes before the next one is built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def step_ms(b: int, output_len: int = args.output_len, **kw) -> float:  # every engine of the table is so built
        return engine_step_ms(model, b, args.input_len, output_len, args.spec, args.num_spec_tokens, drafter_tensors,
                              proposer=proposer and proposer(), enforce_eager=args.enforce_eager,
                              max_num_batched_tokens=args.max_num_batched_tokens, **kw)

    rows = []
    for b in args.batch_sizes:
        if args.profile:
            prof = step_ms(b, 16, profile=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        extra = {}
        ms = step_ms(b, out=extra, probe=RoutingProbe(model, args.uniform_routing, num_ep_ranks))
        mem_gb = round(torch.cuda.max_memory_allocated(device) / 1e9, 1) if device.type == "cuda" else None
        invariant = {}
        if getattr(args, "batch_invariant_cost", False):  # the same model and requests, the mode on
            release()
            set_batch_invariant(True)
            try:
                bi_ms = step_ms(b, out=invariant)
            finally:
                set_batch_invariant(False)
            invariant = {"invariant_ms_per_step": round(bi_ms, 3), "invariant_cost": round(bi_ms / ms - 1, 4),
                         "invariant_preemptions": invariant["preemptions"]}
        active = step_bytes(model, b, args.input_len + args.output_len // 2, 1 + k, args.uniform_routing)
        floor = 1000 * active / bandwidth
        row = {"batch": b, "rank": rank, "ms_per_step": round(ms, 3),
               "tok_s": round(extra.get("tok_s", 1000 * b / ms), 1),
               "floor_ms": round(floor, 4), "x_floor": round(ms / floor, 1),
               "active_GB": round(active / 1e9, 3), "active_MB_per_token": round(active / 1e6 / (b * (1 + k)), 2),
               "mem_GB": mem_gb,  # the default engine's peak (before the invariant one's)
               "kv_blocks": extra["kv_blocks"], "preemptions": extra["preemptions"],
               **extra.get("load", {}), **invariant}
        if "tau" in extra:
            row |= {"tau": round(extra["tau"], 2), "split_step_ms": round(extra["split_step_ms"], 3),
                    "verify_ms": round(extra["verify_ms"], 3), "draft_ms": round(extra["draft_ms"], 3),
                    "draft_share": round(extra["draft_share"], 3)}
        if args.profile:
            row |= {"kernels_per_step": prof["kernels_per_step"], "syncs_per_step": prof["syncs_per_step"],
                    "gpu_busy": prof["gpu_busy_fraction"], "kernel_groups": prof["kernel_groups"]}
        if hf is not None:
            from sparkspec.bench.hf_compare import transformers_step_ms

            t = transformers_step_ms(hf, b, args.input_len, args.output_len)
            row |= {"transformers_ms": round(t, 2), "speedup": round(t / ms, 2)}
        row["bandwidth_GBs"] = round(bandwidth / 1e9, 1)
        gathered = [row]
        if pg is not None:
            gathered = [None] * world
            dist.all_gather_object(gathered, row, group=pg.group)
        if rank == 0:  # the kernel-group tables were printed by the profile; the JSON has them
            cells = [k for k, v in row.items() if not isinstance(v, dict)]
            if not rows:
                print(table_head(cells), flush=True)
            for r in gathered:
                print(table_row(r.get(k) for k in cells), flush=True)
        rows += gathered
        release()
    if rank != 0:
        return rows
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "preset": args.preset, "model": args.model, "dtype": args.dtype, "input_len": args.input_len,
            "output_len": args.output_len, "spec": args.spec, "num_spec_tokens": k or None,
            "tensor_parallel_size": world, "expert_parallel": args.enable_expert_parallel,
            "uniform_routing": args.uniform_routing, "num_layers": model.cfg.num_hidden_layers,
            "weights": "checkpoint" if args.model else random_weights_name(model, args.dtype),
            "build_s": round(build_s, 1),
            "copy_bandwidth_GBs": round(bandwidth / 1e9, 1)}
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {meta['device']}; model built in {build_s:.1f} s "
          f"({meta['weights']}, {meta['num_layers']} layers, {world} rank(s))", flush=True)
    if args.json:
        from sparkspec.bench.common import write_json

        write_json(args.json, rows, meta)
    return rows


def random_weights_name(model, dtype: str) -> str:
    """'random <dtype>', or 'random fp8/fp4 + <dtype>' when the random target took the quantised layout."""
    from sparkspec.loading.quantized import Fp4Linear, Fp8Linear

    kinds = {type(m) for m in model.modules()} & {Fp8Linear, Fp4Linear}
    names = "/".join(n for n, cls in (("fp8", Fp8Linear), ("fp4", Fp4Linear)) if cls in kinds)
    return f"random {names} + {dtype}" if names else f"random {dtype}"


def add_latency_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("latency", help="ms per decode step at fixed batch sizes, vs the bandwidth floor / transformers")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint directory")
    src.add_argument("--preset", default="bench-1b", help="config preset with random weights (default bench-1b)")
    p.add_argument("--random-weights", action="store_true",
                   help="with --preset (always so): random weights made on each rank's device, for its slice only")
    p.add_argument("--num-layers", type=int, default=None,
                   help="with --preset: keep only the first N target layers (real layer shapes, fewer layers)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many processes (one per GPU: NCCL; gloo on CPU)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: whole routed experts per process")
    p.add_argument("--uniform-routing", action="store_true",
                   help="route token t's j-th expert to (t*topk + j) mod E: every expert equally loaded")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill chunk (default: the whole batch's prompts in one step)")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--spec", default="none", choices=SPEC_METHODS)
    p.add_argument("--num-spec-tokens", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quantization", default="auto", choices=["auto", "keep", "dequantize"],
                   help="keep: FP8 attention / shared-expert and FP4 routed-expert layers stay quantised (random "
                        "weights: made in that layout); auto: so off the CPU when the checkpoint / preset is "
                        "quantised; dequantize: all in --dtype")
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA / HIP graphs")
    p.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    p.add_argument("--batch-invariant-cost", action="store_true",
                   help="time every batch size twice in this process on the same model and requests, with "
                        "batch-invariant mode off and then on: the row adds invariant_ms_per_step and "
                        "invariant_cost (its ratio to the default step, minus 1)")
    p.add_argument("--profile", action="store_true", help="also profile 8 decode steps per batch size")
    p.add_argument("--json", default=None, help="write the rows here")
    p.set_defaults(func=cmd_latency)
    return p


def cmd_latency(args) -> int:
    run(args)
    return 0


def main(argv: list[str] | None = None) -> None:
    """Standalone entry (`python -m sparkspec.bench.latency ...`), the same flags as `sparkspec bench latency`."""
    sub = argparse.ArgumentParser(prog="sparkspec bench").add_subparsers(dest="bench_command", required=True)
    run(add_latency_parser(sub).parse_args(argv))


if __name__ == "__main__":
    main()
