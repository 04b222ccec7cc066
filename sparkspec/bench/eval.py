"""`sparkspec eval`: acceptance of speculative methods on DeepSpec-format prompt sets, batch size 1.

Protocol (DeepSpec `eval.py`, as restated in ../shared/reference/dspark_spec.md §5): the first turn of each
prompt (`turns[0]`) with the checkpoint's chat template, one request at a time, `--max-tokens` new tokens,
seed = `--seed` + prompt index. Metrics per dataset, pooled over all verify steps of all prompts:
* τ = Σ(accepted + 1) / #steps (includes the bonus / recovered token; no speculation gives 1);
* accept_rate@i = steps whose drafts 1..i were all accepted / steps that drafted position i (prefix survival,
  DeepSpec's `accept_rate@k`); cond@i = accept_rate@i / accept_rate@(i-1), the conditional acceptance of the
  DSpark paper's Fig. 2 (exact when every step drafts k tokens, as DSpark and MTP do; for n-gram, whose
  drafts vary in length, it is an approximation and can exceed 1);
* tok/s = generated tokens / wall time of the decode loop (prefill included), and the same for plain decoding
  when `--baseline` is given (speed ratio in one run).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DATASETS = ("gsm8k", "humaneval", "mt-bench")


def add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="acceptance length and per-position acceptance on eval prompt sets")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the shipped demo)")
    p.add_argument("--spec", default="dspark", help="dspark | mtp | ngram, or a comma list")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma list of <name>.jsonl files")
    p.add_argument("--data-dir", type=Path, default=None, help="where <name>.jsonl live (default: search)")
    p.add_argument("--temperature", default="0", help="0 | 1, or a comma list")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-spec-tokens", type=int, default=None, help="k (default: block size / 1 / 4)")
    p.add_argument("--baseline", action="store_true", help="also time plain decoding (tokens/s ratio)")
    p.add_argument("--seed", type=int, default=980406)
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="PNG of acceptance by position per method")
    p.set_defaults(func=cmd_eval)


def load_prompts(name: str, data_dir: Path | None, tokenizer, num: int) -> list[list[int]]:
    from sparkspec.train.data import find_eval_file, read_turns

    path = data_dir / f"{name}.jsonl" if data_dir else find_eval_file(name)
    if not path.is_file():
        raise FileNotFoundError(f"eval dataset '{name}': {path} not found")
    turns = read_turns(path)[:num]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t[0]}])) for t in turns]


def run_method(model, tokenizer, drafter_tensors, method: str, prompts: list[list[int]], temperature: float,
               max_tokens: int, k: int | None, seed: int) -> dict:
    """Batch-1 generation of every prompt -> pooled metrics (method 'none' = plain decoding)."""
    from sparkspec.generation import Generator
    from sparkspec.sampling_params import SamplingParams
    from sparkspec.spec_decode import SpecMetrics, SpeculativeGenerator, build_proposer

    if method == "none":
        gen = Generator(model, tokenizer)
    else:
        proposer = build_proposer(method, model, drafter_tensors, num_spec_tokens=k)
        gen = SpeculativeGenerator(model, tokenizer, proposer)
    metrics, tokens, t0 = [], 0, time.perf_counter()
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        (seq,) = gen.generate([ids], params)
        tokens += len(seq.output_ids)
        if method != "none":
            metrics.append(seq.spec_metrics)
    wall = time.perf_counter() - t0
    row = {"method": method, "temperature": temperature, "prompts": len(prompts), "tokens": tokens,
           "time_s": round(wall, 2), "tok_s": round(tokens / wall, 2)}
    if method != "none":
        m = SpecMetrics.aggregate(metrics, method, gen.num_spec_tokens)
        surv = m.acceptance_rate_per_position
        cond = [surv[0]] + [surv[i] / surv[i - 1] if surv[i - 1] else 0.0 for i in range(1, len(surv))]
        row.update(k=m.num_spec_tokens, tau=round(m.acceptance_length, 4), steps=m.num_steps,
                   accept_rate=[round(x, 4) for x in surv], cond_accept=[round(x, 4) for x in cond])
    return row


def format_table(rows: list[dict]) -> str:
    k = max((r.get("k", 0) for r in rows), default=0)
    head = ["dataset", "method", "T", "n", "tau", "tok/s"] + [f"c@{i + 1}" for i in range(k)]
    lines = [head]
    for r in rows:
        cond = r.get("cond_accept", [])
        lines.append([r["dataset"], r["method"], f"{r['temperature']:g}", str(r["prompts"]),
                      f"{r['tau']:.3f}" if "tau" in r else "1", f"{r['tok_s']:.1f}"]
                     + [f"{cond[i]:.3f}" if i < len(cond) else "" for i in range(k)])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for r in rows:
            if r["dataset"] == ds and "cond_accept" in r:
                xs = range(1, len(r["cond_accept"]) + 1)
                ax.plot(xs, r["cond_accept"], marker="o", label=f"{r['method']} T={r['temperature']:g} "
                                                                 f"(tau {r['tau']:.2f})")
        ax.set_title(ds)
        ax.set_xlabel("draft position")
        ax.set_ylabel("conditional acceptance")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_json(path: Path, model_dir: Path, model, args, rows: list[dict]) -> None:
    import os
    import platform

    import torch

    dev = str(next(model.parameters()).device)
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else f"cpu ({os.cpu_count()} cores, " \
        f"{torch.get_num_threads()} threads, {platform.machine()})"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": str(model_dir), "device": name, "max_tokens": args.max_tokens,
                                "seed": args.seed, "results": rows}, indent=1) + "\n")


def cmd_eval(args) -> int:
    from sparkspec.checkpoint import load_checkpoint

    model_dir = args.model
    if model_dir is None:
        from sparkspec.cli import DEFAULT_MODEL

        model_dir = DEFAULT_MODEL
    ck = load_checkpoint(model_dir, device=args.device)
    if ck.tokenizer is None:
        raise ValueError(f"{model_dir}: no tokenizer.json (eval needs the chat template)")
    methods = [m.strip() for m in args.spec.split(",") if m.strip()]
    temps = [float(t) for t in args.temperature.split(",")]
    rows = []
    for ds in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        prompts = load_prompts(ds, args.data_dir, ck.tokenizer, args.num_prompts)
        for t in temps:
            for method in (["none"] if args.baseline else []) + methods:
                row = {"dataset": ds, **run_method(ck.model, ck.tokenizer, ck.drafter_tensors, method, prompts, t,
                                                   args.max_tokens, args.num_spec_tokens, args.seed)}
                rows.append(row)
                print(f"{ds} {method} T={t:g}: tau {row.get('tau', 1.0)}  {row['tok_s']} tok/s  "
                      f"cond {row.get('cond_accept', '')}", file=sys.stderr, flush=True)
                if args.json:  # rewritten after every row: a run cut short keeps what it measured
                    write_json(args.json, model_dir, ck.model, args, rows)
    print(format_table(rows))
    if args.baseline:
        for r in rows:
            base = next((b for b in rows if b["method"] == "none" and b["dataset"] == r["dataset"]
                         and b["temperature"] == r["temperature"]), None)
            if base and r["method"] != "none":
                r["speedup_vs_none"] = round(r["tok_s"] / base["tok_s"], 3)
                print(f"{r['dataset']} T={r['temperature']:g} {r['method']}: {r['speedup_vs_none']:.2f}x vs none")
    if args.json:
        write_json(args.json, model_dir, ck.model, args, rows)
    if args.plot:
        plot(rows, args.plot)
    return 0
