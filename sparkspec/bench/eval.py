"""`sparkspec eval`: acceptance of speculative methods on DeepSpec-format prompt sets, batch size 1.

Protocol (DeepSpec `eval.py`): the first turn of each prompt (`turns[0]`) with the checkpoint's chat template,
one request at a time through the engine (`max_num_seqs=1`, fixed verification budget: every step drafts k
tokens), `--max-tokens` new tokens, seed = `--seed` + prompt index. Metrics per dataset, pooled over all
verify steps of all prompts, as defined in `sparkspec.spec_decode.metrics`: τ, accept_rate@i (prefix survival)
and cond@i = accept_rate@i / accept_rate@(i-1) (the DSpark paper's Fig. 2). tok/s = generated tokens / wall
time of the generation loop (prefill included, engine start-up excluded), and the same for plain decoding when
`--baseline` is given (speed ratio in one run). `--sampling-scheme` picks how sampled rows draw and verify
(`EngineConfig.sampling_scheme`; the prompts carry seeds, so "auto" is the Gumbel-max scheme); a comma list
measures each, one engine per (method, scheme), on the same prompts and seeds. `--gumbel-draft-temperature`
measures the Gumbel rows' proposal rule (`sampling.sample_draft`): the output is the same for every value (the
scheme is drafter-invariant), only τ moves. `--paired` (DSpark) replaces the speculative runs by one plain decoding
per prompt and replays both schemes on its sequences (`bench/replay.py`): Gumbel τ exactly, rejection τ paired
with it, so their ratio is not lost in the sequences' sampling noise.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from sparkspec.engine.config import DEFAULT_SAMPLING_SCHEME, SAMPLING_SCHEMES

DATASETS = ("gsm8k", "humaneval", "mt-bench")


def add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="acceptance length and per-position acceptance on eval prompt sets")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the shipped demo)")
    p.add_argument("--spec", default="dspark", help="dspark | mtp | ngram, or a comma list")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma list of <name>.jsonl files")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where <name>.jsonl live (default: $SPARKSPEC_EVAL_DIR, else the repository's data/eval)")
    p.add_argument("--temperature", default="0", help="0 | 1, or a comma list")
    p.add_argument("--sampling-scheme", default=DEFAULT_SAMPLING_SCHEME,
                   help=f"{' | '.join(SAMPLING_SCHEMES)}, or a comma list (default {DEFAULT_SAMPLING_SCHEME}: the "
                        "prompts carry seeds, so gumbel)")
    p.add_argument("--gumbel-draft-temperature", default="1",  # sampling.DEFAULT_GUMBEL_DRAFT_TEMPERATURE
                   help="the drafter's temperature s on Gumbel-max rows (argmax(log q / s + G)), or a comma list")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-spec-tokens", type=int, default=None, help="k (default: block size / 1 / 4)")
    p.add_argument("--baseline", action="store_true", help="also time plain decoding (tokens/s ratio)")
    p.add_argument("--paired", action="store_true",
                   help="DSpark: replay rejection and Gumbel (each --gumbel-draft-temperature) on plain decoding's "
                        "seeded sequences instead of running them (paired tau, no timing)")
    p.add_argument("--paired-reps", type=int, default=200, help="rejection replays per sequence with --paired")
    p.add_argument("--seed", type=int, default=980406)
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="PNG of acceptance by position per method")
    p.set_defaults(func=cmd_eval)


def load_prompts(name: str, data_dir: Path | None, tokenizer, num: int) -> list[list[int]]:
    from sparkspec.paths import find_eval_file, read_turns

    turns = read_turns(find_eval_file(name, data_dir))[:num]
    return [tokenizer.encode_chat([{"role": "user", "content": t[0]}]) for t in turns]


def make_engine(checkpoint, method: str, k: int | None, max_len: int, scheme: str = DEFAULT_SAMPLING_SCHEME,
                draft_temperature: float | None = None):
    """One batch-1 engine per (method, scheme, Gumbel draft temperature) (method 'none' = plain decoding), shared by
    every dataset and temperature."""
    from sparkspec.engine.llm import LLM
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.ops.sampling import DEFAULT_GUMBEL_DRAFT_TEMPERATURE
    from sparkspec.spec_decode.build import build_proposer

    llm = LLM(checkpoint, speculative=method, num_spec_tokens=k, spec_budget="fixed", max_num_seqs=1,
              max_model_len=max_len, sampling_scheme=scheme)
    if draft_temperature not in (None, DEFAULT_GUMBEL_DRAFT_TEMPERATURE):  # no EngineConfig field: own drafter
        proposer = build_proposer(method, checkpoint.model, checkpoint.drafter_tensors, k, draft_temperature)
        llm.engine = LLMEngine(checkpoint.model, checkpoint.tokenizer, llm.engine.config, checkpoint.drafter_tensors,
                               proposer=proposer)
    return llm


def run_method(llm, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int) -> dict:
    """Generate every prompt, one at a time -> the pooled metrics row."""
    from sparkspec.sampling_params import SamplingParams
    from sparkspec.spec_decode.metrics import SpecMetrics

    metrics, tokens, t0 = [], 0, time.perf_counter()
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        (out,) = llm.generate([ids], params)
        tokens += len(out.token_ids)
        metrics.append(SpecMetrics.from_request(llm.method, llm.num_spec_tokens, out.metrics))
    wall = time.perf_counter() - t0
    row = {"method": llm.method, "temperature": temperature, "prompts": len(prompts), "tokens": tokens,
           "time_s": round(wall, 2), "tok_s": round(tokens / wall, 2)}
    if llm.method != "none":
        m = SpecMetrics.aggregate(metrics, llm.method, llm.num_spec_tokens)
        row.update(k=m.num_spec_tokens, tau=round(m.acceptance_length, 4), steps=m.num_steps,
                   accept_rate=[round(x, 4) for x in m.accept_rate_per_position],
                   cond_accept=[round(x, 4) for x in m.conditional_accept_rate])
    return row


def run_paired(llm, drafter, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int,
               draft_temps: list[float], reps: int) -> list[dict]:
    """Plain decoding of every prompt (Gumbel-max, seed = `seed` + index), then each scheme replayed on its sequences
    (`bench.replay`) -> a row for rejection and one per Gumbel draft temperature."""
    import torch

    from sparkspec.bench import replay
    from sparkspec.ops.sampling import SamplingTensors
    from sparkspec.sampling_params import SamplingParams

    counts = {s: [0, 0] for s in ["rejection", *draft_temps]}  # accepted drafts, verify steps
    gen, t0, k = torch.Generator().manual_seed(seed), time.perf_counter(), drafter.block_size
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        (out,) = llm.generate([ids], params)
        b = replay.dspark_blocks(llm.checkpoint.model, drafter, list(ids) + list(out.token_ids), len(ids))
        room = replay.engine_room(b, k, out.finish_reason == "length")
        st = SamplingTensors(torch.tensor([params.device_temperature]), torch.zeros(1, dtype=torch.int64),
                             torch.ones(1), torch.tensor([seed + i]), params.greedy, False, False, True)
        for s in draft_temps:
            accepted, steps = replay.chain(replay.gumbel_lengths(b, st, s), room)
            counts[s][0] += accepted
            counts[s][1] += steps
        for lengths in replay.rejection_lengths(b, st, reps, gen):
            accepted, steps = replay.chain(lengths, room)
            counts["rejection"][0] += accepted
            counts["rejection"][1] += steps
    wall = time.perf_counter() - t0
    return [{"method": "dspark", "scheme": "rejection" if s == "rejection" else "gumbel",
             "gumbel_draft_temperature": 1.0 if s == "rejection" else s, "temperature": temperature,
             "prompts": len(prompts), "estimator": "paired", "time_s": round(wall, 2), "tok_s": 0.0, "k": k,
             "tau": round((c[0] + c[1]) / max(c[1], 1), 4), "steps": c[1] // (reps if s == "rejection" else 1)}
            for s, c in counts.items()]


def format_table(rows: list[dict]) -> str:
    k = max((r.get("k", 0) for r in rows), default=0)
    head = ["dataset", "method", "scheme", "s", "T", "n", "tau", "tok/s"] + [f"c@{i + 1}" for i in range(k)]
    lines = [head]
    for r in rows:
        cond = r.get("cond_accept", [])
        lines.append([r["dataset"], r["method"], r.get("scheme", ""), f"{r.get('gumbel_draft_temperature', 1):g}",
                      f"{r['temperature']:g}", str(r["prompts"]),
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
                ax.plot(xs, r["cond_accept"], marker="o", label=f"{r['method']} {r.get('scheme', '')} "
                                                                 f"T={r['temperature']:g} (tau {r['tau']:.2f})")
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
    from sparkspec.bench.common import require_plotting
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.paths import DEFAULT_MODEL, find_eval_file

    if args.plot:
        require_plotting()
    model_dir = args.model or DEFAULT_MODEL
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for ds in datasets:  # a missing file is reported before the model loads
        find_eval_file(ds, args.data_dir)
    methods = (["none"] if args.baseline else []) + [m.strip() for m in args.spec.split(",") if m.strip()]
    temps = [float(t) for t in args.temperature.split(",")]
    schemes = [x.strip() for x in args.sampling_scheme.split(",") if x.strip()]
    for x in schemes:
        if x not in SAMPLING_SCHEMES:
            raise ValueError(f"--sampling-scheme {x!r}: expected one of {SAMPLING_SCHEMES}")
    draft_temps = [float(x) for x in args.gumbel_draft_temperature.split(",")]
    runs = [(m, x, s) for m in methods for x in (schemes if m != "none" else schemes[:1])  # plain: one of each
            for s in (draft_temps if m != "none" and x != "rejection" else draft_temps[:1])]
    ck = load_checkpoint(model_dir, device=args.device, progress=True)
    if ck.tokenizer is None:
        raise ValueError(f"{model_dir}: no tokenizer.json (eval needs the chat template)")
    prompts = {ds: load_prompts(ds, args.data_dir, ck.tokenizer, args.num_prompts) for ds in datasets}
    longest = max((len(p) for ps in prompts.values() for p in ps), default=1)
    max_len = min(longest + args.max_tokens, ck.config.max_position_embeddings)
    if args.paired:
        return cmd_paired(args, ck, prompts, max_len, temps, draft_temps, model_dir)
    engines = {r: make_engine(ck, r[0], args.num_spec_tokens, max_len, r[1], r[2]) for r in runs}
    rows = []
    for ds in datasets:
        for t in temps:
            for method, scheme, s in runs:
                row = {"dataset": ds, "scheme": scheme, "gumbel_draft_temperature": s,
                       **run_method(engines[method, scheme, s], prompts[ds], t, args.max_tokens, args.seed)}
                rows.append(row)
                print(f"{ds} {method} {scheme} s={s:g} T={t:g}: tau {row.get('tau', 1.0)}  {row['tok_s']} tok/s  "
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


def cmd_paired(args, ck, prompts: dict, max_len: int, temps: list[float], draft_temps: list[float], model_dir) -> int:
    """`--paired`: one plain engine (Gumbel-max), DSpark replayed on its sequences."""
    from sparkspec.spec_decode.build import build_proposer

    if args.spec.strip() != "dspark" or args.num_spec_tokens not in (None, ck.config.dspark_block_size):
        raise ValueError("--paired replays DSpark at its block size only (--spec dspark, no --num-spec-tokens)")
    llm = make_engine(ck, "none", None, max_len, "gumbel")
    drafter = build_proposer("dspark", ck.model, ck.drafter_tensors).drafter
    rows = []
    for ds, ps in prompts.items():
        for t in temps:
            for row in run_paired(llm, drafter, ps, t, args.max_tokens, args.seed, draft_temps, args.paired_reps):
                rows.append({"dataset": ds, **row})
                print(f"{ds} paired {row['scheme']} s={row['gumbel_draft_temperature']:g} T={t:g}: tau {row['tau']}",
                      file=sys.stderr, flush=True)
            if args.json:
                write_json(args.json, model_dir, ck.model, args, rows)
    print(format_table(rows))
    for r in rows:
        if r["scheme"] == "gumbel":
            base = next(b for b in rows if b["scheme"] == "rejection" and b["dataset"] == r["dataset"]
                        and b["temperature"] == r["temperature"])
            print(f"{r['dataset']} T={r['temperature']:g} s={r['gumbel_draft_temperature']:g}: tau(gumbel) / "
                  f"tau(rejection) = {r['tau'] / base['tau']:.3f}")
    if args.json:
        write_json(args.json, model_dir, ck.model, args, rows)
    return 0
