"""`sparkspec bench latency`: milliseconds per decode step at fixed batch sizes, against the memory-bandwidth
floor and (optionally) transformers' `DeepseekV4ForCausalLM.generate` on the same weights, in one process.

Per batch size B: B requests of `input_len` random prompt tokens are prefilled, then `output_len` tokens are
decoded; the decode steps are timed (wall clock, the device synchronised before and after). The floor of one
step is the bytes it must read, active weights (every dense weight, the shared experts, and the routed experts
that B tokens are expected to hit) plus the KV rows each query reads, divided by the device copy bandwidth
measured in the same run. The ratio to it says how far the step is from memory-bound. With speculation
(`--spec`, on a checkpoint with drafter weights) a row also gives τ and the split of a step into verifying k
drafts and drafting the next k (`draft_share` = draft / verify).
"""

from __future__ import annotations

import argparse
import time

import torch

from sparkspec.config import CSA, ModelConfig


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


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def step_bytes(model, batch: int, context: int) -> int:
    """Bytes a decode step of `batch` requests at `context` positions must read at least."""
    cfg: ModelConfig = model.cfg
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name or name == "embed.weight":
            continue
        total += p.numel() * p.element_size()
    E, A = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = E * (1 - (1 - A / E) ** batch)  # expected distinct routed experts per layer
    expert = sum(p.numel() * p.element_size() for p in model.layers[0].ffn.experts[0].parameters())
    total += int(cfg.num_hidden_layers * hit * expert)
    elt = next(model.parameters()).element_size()
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
                   out: dict | None = None) -> float | dict:
    """Decode milliseconds per step of `LLMEngine` (prefill excluded); with `profile`, the profile of a few
    decode steps instead. `out` receives tok/s and, with speculation, τ and the draft / verify split."""
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.sampling_params import SamplingParams

    device = next(model.parameters()).device
    cfg = EngineConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=max(batch * input_len, 64),
                       max_model_len=input_len + output_len + 16, speculative=spec, num_spec_tokens=num_spec_tokens,
                       spec_budget="fixed", **({"enforce_eager": True} if enforce_eager else {}))  # older trees too
    eng = LLMEngine(model, None, cfg, drafter_tensors or {})
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
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
    sync(device)
    t0, steps = time.perf_counter(), 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    sync(device)
    seconds = time.perf_counter() - t0
    if out is not None:
        out["tok_s"] = (st.num_generation_tokens - tokens0) / seconds
        if eng.spec is not None and st.num_spec_steps > spec0:
            n = st.num_spec_steps - spec0
            out["tau"] = (st.num_accepted - acc0 + n) / n
            out |= step_split(eng, batch, input_len)
    return 1000 * seconds / max(steps, 1)


def step_split(eng, batch: int, context_len: int, repeats: int = 5) -> dict:
    """One decode step of `batch` requests cut in two: verifying k drafts (the target forward, the rejection
    sampler and the copy back), and drafting the next k (observe + propose), by difference. Runs on the engine's
    pools once its requests are done."""
    spec, runner = eng.spec, eng.runner
    k = spec.num_spec_tokens
    items = spec.probe_requests(runner, batch, context_len)
    drafts = [[2] * k for _ in items]
    verify = spec.time_step(runner, items, drafts, 0, repeats)
    full = spec.time_step(runner, items, drafts, k if spec.proposer.on_device else 0, repeats)
    return {"verify_ms": 1000 * verify, "draft_ms": 1000 * max(full - verify, 0.0),
            "draft_share": max(full - verify, 0.0) / verify}


def profile_steps(eng, device: torch.device, num_steps: int = 8) -> dict:
    """Kernel launches, host syncs and device busy time per decode step (torch profiler)."""
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
    busy = sum(getattr(e, "device_time", 0) or getattr(e, "cuda_time", 0) for e in kernels) / 1e6
    out = {"kernels_per_step": len(kernels) / num_steps, "launches_per_step": launches / num_steps, "syncs_per_step": syncs / num_steps,
           "gpu_busy_fraction": round(busy / wall, 3) if wall else 0.0}
    print(f"profile over {num_steps} decode steps: {out}", flush=True)
    return out


def transformers_config(cfg: ModelConfig) -> dict:
    """Our config in the form `transformers.DeepseekV4Config` takes."""
    d = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
             num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
             partial_rotary_factor=cfg.qk_rope_head_dim / cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
             o_lora_rank=cfg.o_lora_rank, o_groups=cfg.o_groups, sliding_window=cfg.sliding_window,
             layer_types=list(cfg.layer_types), compress_rates=dict(cfg.compress_rates),
             mlp_layer_types=list(cfg.mlp_layer_types), index_n_heads=cfg.index_n_heads,
             index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, n_routed_experts=cfg.n_routed_experts,
             num_experts_per_tok=cfg.num_experts_per_tok, n_shared_experts=cfg.n_shared_experts,
             moe_intermediate_size=cfg.moe_intermediate_size, hc_mult=cfg.hc_mult,
             hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_norm_eps=cfg.rms_norm_eps,
             routed_scaling_factor=cfg.routed_scaling_factor, swiglu_limit=cfg.swiglu_limit,
             max_position_embeddings=cfg.max_position_embeddings, bos_token_id=cfg.bos_token_id,
             eos_token_id=cfg.eos_token_id)
    if cfg.yarn is not None:
        d["rope_parameters"] = {"rope_type": "yarn", "factor": cfg.yarn.factor,
                                "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
                                "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow}
    return d


def transformers_pair(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(transformers model, our model) with the same random weights: built by transformers, copied into ours."""
    import transformers

    from sparkspec.models.deepseek_v4 import DeepseekV4Model
    from sparkspec.models.weights import _split_fused_experts, load_state, official_name

    torch.manual_seed(seed)
    with torch.device(device):
        hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**transformers_config(cfg)))
    hf = hf.to(dtype).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape, device=b.device))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        name = official_name(name)
        if not _split_fused_experts(name, t, tensors):
            tensors[name] = t
    with torch.device(device):
        ours = DeepseekV4Model(cfg)
    ours = ours.to(dtype)
    if hasattr(ours, "keep_fp32"):
        ours.keep_fp32()
    load_state(ours, {k: v for k, v in tensors.items() if not k.startswith("mtp.")})
    return hf, ours.eval()


def transformers_step_ms(hf, batch: int, input_len: int, output_len: int, seed: int = 0) -> float:
    """Decode milliseconds per step of `generate` (greedy), prefill subtracted."""
    device = next(hf.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, hf.config.vocab_size, (batch, input_len), generator=g).to(device)

    def run(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    run(2)  # warm-up
    return 1000 * (run(output_len) - run(1)) / (output_len - 1)


def run(args) -> list[dict]:
    from sparkspec.bench.common import write_json

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    cfg = None
    if args.model is None:
        cfg = ModelConfig.from_file(args.preset) if args.preset.endswith(".json") else ModelConfig.preset(args.preset)
    hf = None
    drafter_tensors = {}
    if args.model is not None:
        from sparkspec.checkpoint import load_checkpoint

        ckpt = load_checkpoint(args.model, device=str(device), dtype=args.dtype, progress=True)
        model, drafter_tensors = ckpt.model, ckpt.drafter_tensors
    elif args.compare_transformers:
        try:
            hf, model = transformers_pair(cfg, device, dtype)
        except ImportError:
            print("transformers is not installed: skipping the comparison")
            args.compare_transformers = False
    if args.model is None and hf is None:
        from sparkspec.models.deepseek_v4 import DeepseekV4Model

        torch.manual_seed(0)
        with torch.device(device):
            model = DeepseekV4Model(cfg)
        model = model.to(dtype).keep_fp32().eval()
    bandwidth = copy_bandwidth(device) if device.type != "cpu" else copy_bandwidth(device, 1 << 26)
    rows = []
    for b in args.batch_sizes:
        if args.profile:
            prof = engine_step_ms(model, b, args.input_len, 16, args.spec, args.num_spec_tokens, drafter_tensors,
                                  profile=True, enforce_eager=args.enforce_eager)
        extra = {}
        ms = engine_step_ms(model, b, args.input_len, args.output_len, args.spec, args.num_spec_tokens,
                            drafter_tensors, enforce_eager=args.enforce_eager, out=extra)
        floor = 1000 * step_bytes(model, b, args.input_len + args.output_len // 2) / bandwidth
        row = {"batch": b, "ms_per_step": round(ms, 3), "tok_s": round(extra.get("tok_s", 1000 * b / ms), 1),
               "floor_ms": round(floor, 4), "x_floor": round(ms / floor, 1)}
        if "tau" in extra:
            row |= {"tau": round(extra["tau"], 2), "verify_ms": round(extra["verify_ms"], 3),
                    "draft_ms": round(extra["draft_ms"], 3), "draft_share": round(extra["draft_share"], 3)}
        if args.profile:
            row |= {"kernels_per_step": prof["kernels_per_step"], "syncs_per_step": prof["syncs_per_step"],
                    "gpu_busy": prof["gpu_busy_fraction"]}
        if hf is not None:
            t = transformers_step_ms(hf, b, args.input_len, args.output_len)
            row |= {"transformers_ms": round(t, 2), "speedup": round(t / ms, 2)}
        if not rows:
            print("| " + " | ".join(row) + " |\n|" + "---|" * len(row), flush=True)
        rows.append(row)
        print("| " + " | ".join(str(v) for v in row.values()) + " |", flush=True)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "preset": args.preset, "model": args.model, "dtype": args.dtype, "input_len": args.input_len,
            "output_len": args.output_len, "spec": args.spec, "copy_bandwidth_GBs": round(bandwidth / 1e9, 1)}
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {meta['device']}")
    if args.json:
        write_json(args.json, rows, meta)
    return rows


def add_latency_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("latency", help="ms per decode step at fixed batch sizes, vs the bandwidth floor / transformers")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint directory")
    src.add_argument("--preset", default="bench-1b", help="config preset with random weights (default bench-1b)")
    p.add_argument("--random-weights", action="store_true", help="with --preset: weights initialised on the device")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--spec", default="none", choices=["none", "dspark", "mtp", "ngram"])
    p.add_argument("--num-spec-tokens", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA / HIP graphs")
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
