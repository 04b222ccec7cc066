"""`sparkspec bench offline`: the engine in-process, a closed loop of `c` requests in flight per concurrency level,
fixed output length (EOS ignored), one engine per speculative setting (`none`, `dspark:fixed`, `dspark:adaptive`,
`mtp:fixed:2`, ...). Prints the table; writes JSON only where `--json` says, and with `--plot` a PNG.
`--profile-host` adds, per level, host us per step and per request and the device-busy fraction
(`sparkspec.bench.host_profile` says how each is measured)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sparkspec.bench.common import RequestTiming, format_table, plot, require_plotting, summarize, write_json
from sparkspec.bench.prompts import load_prompts
from sparkspec.engine.config import (
    BATCH_INVARIANT_HELP,
    DEFAULT_SAMPLING_SCHEME,
    NO_ASYNC_SCHEDULING_HELP,
    SAMPLING_SCHEME_HELP,
    SAMPLING_SCHEMES,
)
from sparkspec.spec_decode.methods import SPEC_METHODS


@dataclass
class Setting:
    method: str
    budget: str = "fixed"
    num_spec_tokens: int | None = None

    @property
    def label(self) -> str:
        if self.method == "none":
            return "none"
        k = "" if self.num_spec_tokens is None else f" k={self.num_spec_tokens}"
        return f"{self.method} {self.budget}{k}"

    @classmethod
    def parse(cls, text: str) -> Setting:
        """'none' | 'METHOD[:fixed|adaptive][:K]'."""
        parts = text.strip().split(":")
        method = parts[0]
        if method not in SPEC_METHODS:
            raise ValueError(f"setting {text!r}: method must be one of {', '.join(SPEC_METHODS)}")
        budget = parts[1] if len(parts) > 1 and parts[1] else "fixed"
        if budget not in ("fixed", "adaptive"):
            raise ValueError(f"setting {text!r}: budget must be fixed or adaptive")
        k = None
        if len(parts) > 2:
            try:
                k = int(parts[2])
            except ValueError:
                raise ValueError(f"setting {text!r}: k must be an integer") from None
        return cls(method, budget, k)


def output_lengths(num_requests: int, output_len: int, ratio: float, seed: int = 0) -> list[int]:
    """Each request's output length: `output_len`, or with `ratio` > 0 drawn uniformly from
    [output_len (1 - ratio), output_len (1 + ratio)] (at least 1), the same list for every setting of a run."""
    if ratio <= 0:
        return [output_len] * num_requests
    import random

    rng = random.Random(seed)
    lo, hi = max(1, round(output_len * (1 - ratio))), max(1, round(output_len * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(num_requests)]


def run_level(engine, prompt_ids: list[list[int]], concurrency: int, num_requests: int, params, method: str,
              k: int, profile_host: bool = False, lengths: list[int] | None = None) -> dict:
    """Closed loop: keep `concurrency` requests in the engine until `num_requests` have finished (request i asks
    for `lengths[i]` tokens where given, else `params.max_tokens`). With `profile_host`, the engine's step pieces
    are timed (`HostProfiler`) for this level only."""
    if not profile_host:
        return closed_loop(engine, prompt_ids, concurrency, num_requests, params, method, k, lengths)
    from sparkspec.bench.host_profile import HostProfiler

    prof = HostProfiler()
    with prof.attach(engine):
        r = closed_loop(engine, prompt_ids, concurrency, num_requests, params, method, k, lengths)
    r["host_profile"] = prof.summary(r["duration"])
    return r


def closed_loop(engine, prompt_ids: list[list[int]], concurrency: int, num_requests: int, params, method: str,
                k: int, lengths: list[int] | None = None) -> dict:
    import dataclasses

    from sparkspec.spec_decode.metrics import SpecMetrics

    pending = [(prompt_ids[i % len(prompt_ids)],
                params if lengths is None else dataclasses.replace(params, max_tokens=lengths[i]))
               for i in range(num_requests)]
    inflight, timings, spec = 0, [], []
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and inflight < concurrency:
            engine.add_request(*pending.pop(0))
            inflight += 1
        for out in engine.step():
            if out.finished:
                inflight -= 1
                m = out.metrics
                timings.append(RequestTiming(m["arrival_time"], m["first_token_time"], m["finish_time"],
                                             len(out.token_ids)))
                spec.append(SpecMetrics.from_request(method, k, m))
    duration = time.perf_counter() - t0
    return {"timings": timings, "duration": duration,
            "spec": SpecMetrics.aggregate(spec, method, k) if method != "none" else None}


@dataclass
class Workload:
    """What every setting of one run is measured on: the loaded model, the prompts and the sampling."""

    ckpt: object
    prompt_ids: list[list[int]]
    params: object
    settings: list[Setting]
    concurrencies: list[int]


def load_workload(args) -> Workload:
    import torch

    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.platform import check_device
    from sparkspec.sampling_params import SamplingParams

    check_device(args.device)  # before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [Setting.parse(s) for s in args.settings.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    ckpt = load_checkpoint(args.model, device=args.device, dtype=args.dtype, progress=True)
    if ckpt.tokenizer is None:
        raise ValueError(f"{args.model}: the benchmark needs a tokenizer")
    texts = load_prompts(args.dataset or None, num=max(args.num_prompts, 1))
    tok = ckpt.tokenizer
    limit = args.max_prompt_tokens
    if args.shared_prefix_tokens:
        prompt_ids = shared_prefix_prompts(tok, texts, args.shared_prefix_tokens, limit)
    else:
        prompt_ids = [tok.encode_chat([{"role": "user", "content": t}])[-limit:] for t in texts]
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)
    return Workload(ckpt, prompt_ids, params, settings, concurrencies)


def build_engine(args, work: Workload, setting: Setting):
    """-> (the setting's engine, warmed up, on the workload's model; its start-up seconds)."""
    from sparkspec.engine.llm import build_llm
    from sparkspec.sampling_params import SamplingParams

    t0 = time.perf_counter()  # every setting's engine shares the one loaded model
    engine = build_llm(work.ckpt, speculative=setting.method, spec_budget=setting.budget,
                       num_spec_tokens=setting.num_spec_tokens, max_num_seqs=max(work.concurrencies),
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       enforce_eager=args.enforce_eager,
                       enable_prefix_caching=args.enable_prefix_caching,
                       sampling_scheme=args.sampling_scheme,
                       batch_invariant=getattr(args, "batch_invariant", False),
                       async_scheduling=getattr(args, "async_scheduling", None)).engine
    engine.emit_unfinished = False  # the loop reads finished requests only, as `LLM.generate` does
    startup = time.perf_counter() - t0
    engine.generate(work.prompt_ids[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    return engine, startup


def measure_level(args, work: Workload, engine, setting: Setting, c: int, startup: float) -> dict:
    """One concurrency level of one setting -> its row (printed to stderr as it ends)."""
    import torch

    from sparkspec.sampling_params import SamplingParams

    prompt_ids = work.prompt_ids
    n = max(c * args.requests_per_client, args.min_requests)
    k = engine.spec.num_spec_tokens if engine.spec is not None else 0
    # untimed: c short requests compile the kernels of this batch size (Triton JIT per new shape)
    engine.generate([prompt_ids[i % len(prompt_ids)] for i in range(c)], SamplingParams(max_tokens=k + 4,
                                                                                        ignore_eos=True))
    queried, hit = engine.stats.num_prefix_cache_queries, engine.stats.num_prefix_cache_hits
    steps, skipped = engine.stats.num_steps, engine.stats.num_drafter_skipped_steps
    cold = engine.stats.num_context_skipped_steps
    preempted = engine.scheduler.num_preemptions
    budget = engine.spec.budget if engine.spec is not None else None
    if getattr(args, "trace_budget", None) and budget is not None:
        budget.trace = []  # this level's decisions and filed steps
    ratio = getattr(args, "output_len_ratio", 0.0)
    lengths = output_lengths(n, args.output_len, ratio) if ratio else None  # None: every request asks `params`
    calibrate = getattr(args, "calibrate_host", False)
    if calibrate:
        from sparkspec.bench.host_profile import host_speed_us

        before = host_speed_us()
    r = run_level(engine, prompt_ids, c, n, work.params, setting.method, k, args.profile_host, lengths)
    row = summarize(setting.label, c, r["timings"], r["duration"], r["spec"])
    # what a row's speed also depends on: the KV blocks this engine got, preemptions in the level, and the
    # device memory the process holds (a setting run after others must see what they left behind)
    row["kv_blocks"] = engine.kv_plan.num_blocks
    row["pid"] = os.getpid()  # the process the setting ran in (`--process-per-setting`: one each)
    row["preemptions"] = engine.scheduler.num_preemptions - preempted
    if engine.runner.device.type == "cuda":
        row["device_reserved_GB"] = round(torch.cuda.memory_reserved(engine.runner.device) / 1e9, 2)
    queried = engine.stats.num_prefix_cache_queries - queried  # this level's prompt tokens: the share
    row["prefix_cache_hit_rate"] = round((engine.stats.num_prefix_cache_hits - hit) / max(queried, 1), 4)
    row["engine_startup_s"] = round(startup, 2)
    if calibrate:  # the host's speed around the level (`host_speed_us`: lower is faster)
        row["host_calib_us"] = [before, host_speed_us()]
    if setting.method != "none":  # steps whose drafter ran (the adaptive budget's drafting arm)
        steps, skipped = engine.stats.num_steps - steps, engine.stats.num_drafter_skipped_steps - skipped
        row["drafting_step_frac"] = round(1 - skipped / max(steps, 1), 3)
        # and those that skipped the drafter's context write too (plain decoding settled)
        row["context_skipped_frac"] = round((engine.stats.num_context_skipped_steps - cold) / max(steps, 1), 3)
    if budget is not None and budget.trace is not None:
        row["budget_trace"], budget.trace = budget.trace, None
    extra = ""
    if "host_profile" in r:
        row.update(r["host_profile"])
        extra = (f"  host {row['host_us_per_step']:.0f} us/step {row['host_us_per_req']:.1f} us/req"
                 f"  busy {row['device_busy_frac']:.2f}")
    if calibrate:
        extra += f"  host calib {row['host_calib_us'][0]:.0f}/{row['host_calib_us'][1]:.0f} us"
    print(f"  {setting.label:>20} c={c:<4} {row['tok_s_total']:8.1f} tok/s  tau={row['tau']:.2f}"
          f"  prefix hits {row['prefix_cache_hit_rate']:.3f}"
          + (f"  drafting {row['drafting_step_frac']:.2f}" if "drafting_step_frac" in row else "")
          + (f"  context skipped {row['context_skipped_frac']:.2f}" if row.get("context_skipped_frac") else "") + extra,
          file=sys.stderr)
    return row


def run_offline(args) -> list[dict]:
    """Each setting in turn: its engine built, every concurrency level run, the engine released."""
    from sparkspec.engine.llm import freeze_startup_heap

    work = load_workload(args)
    rows = []
    for setting in work.settings:
        engine, startup = build_engine(args, work, setting)
        if getattr(args, "freeze_gc", False):
            freeze_startup_heap()
        rows += [measure_level(args, work, engine, setting, c, startup) for c in work.concurrencies]
        device = engine.runner.device
        del engine  # before the next setting's engine is built: its graphs, pools and host objects go now
        release(device)
    return rows


def run_interleaved(args) -> list[dict]:
    """`--interleave`: every setting's engine built once in this process (all on the one loaded model), then per
    concurrency level every setting back to back, `--rounds` times, the settings' order rotated each round. A
    ratio between settings then compares levels run seconds apart in one process: on the H200 the same setting
    ran up to 41 % apart in two processes, more than the differences measured. An engine keeps what it learnt
    (the adaptive budget's measurements) from one round to the next, as a server would. -> every row, each with
    its `round`."""
    from sparkspec.engine.llm import freeze_startup_heap

    work = load_workload(args)
    engines = [build_engine(args, work, setting) for setting in work.settings]
    if getattr(args, "freeze_gc", False):
        freeze_startup_heap()
    rows, m = [], len(work.settings)
    for c in work.concurrencies:
        for r in range(args.rounds):
            for i in [(r + j) % m for j in range(m)]:
                engine, startup = engines[i]
                rows.append(measure_level(args, work, engine, work.settings[i], c, startup) | {"round": r})
    device = engines[0][0].runner.device
    del engines
    release(device)
    return rows


def release(device) -> None:
    """Collect what a finished setting's engine held, so the next one runs beside none of it."""
    import gc

    import torch

    gc.unfreeze()  # what `freeze_startup_heap` froze (the engine just dropped among it) is collectable again
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def summarize_trace(events: list[dict]) -> str:
    """One line: decisions per arm (probes apart), steps filed per arm with their mean ms and tokens (and how many
    were filed less their chunks' cost), steps that carried joining requests per arm (their ms and chunks), and the
    steps not filed by why
    (`VerificationBudget.step_boundary`)."""
    from collections import Counter

    decided = Counter(("probe " if e["probe"] else "") + e["decided"] for e in events if "decided" in e)
    parts = [f"{n} {arm}" for arm, n in sorted(decided.items())]
    for arm in ("plain", "spec"):
        filed = [e for e in events if e.get("filed") == arm]
        if filed:
            ms = sum(e["ms"] for e in filed) / len(filed)
            toks = [e["tokens"] for e in filed if e["tokens"] is not None]
            less = sum("chunks_ms" in e for e in filed)  # (requests joining on every step: `StepLog`)
            parts.append(f"filed {arm} {len(filed)} x {ms:.2f} ms"
                         + (f", {sum(toks) / len(toks):.1f} tokens" if toks else "")
                         + (f" ({less} less their chunks)" if less else ""))
        joined = [e for e in events if e.get("joined") == arm]
        if joined:
            chunks = sum(e["chunks"] for e in joined)
            parts.append(f"joined {arm} {len(joined)} x {sum(e['ms'] for e in joined) / len(joined):.2f} ms, "
                         f"{chunks / len(joined):.1f} chunks")
    unfiled = Counter(e["unfiled"] for e in events if "unfiled" in e)
    if unfiled:
        ms = sum(e["ms"] for e in events if "unfiled" in e)
        parts.append("not filed " + ", ".join(f"{n} {why}" for why, n in sorted(unfiled.items()))
                     + f" ({ms:.0f} ms in all)")
    return "; ".join(parts)


def shared_prefix_prompts(tok, texts: list[str], prefix_tokens: int, limit: int) -> list[list[int]]:
    """Each text as the question after one shared system prompt of about `prefix_tokens` tokens (what agents and
    chat front-ends send: `bench.prefix.long_chat`'s notes); a question is cut to about `limit` tokens, never the
    system prompt."""
    from sparkspec.bench.prefix import long_chat

    system = long_chat(tok, prefix_tokens)[0]
    base = len(tok.encode_chat([system, {"role": "user", "content": ""}]))  # the prompt without a question
    out = []
    for text in texts:
        msgs = [system, {"role": "user", "content": text}]
        ids = tok.encode_chat(msgs)
        while len(ids) > base + limit and len(msgs[1]["content"]) > 1:
            msgs[1]["content"] = msgs[1]["content"][: int(len(msgs[1]["content"]) * 0.8)]
            ids = tok.encode_chat(msgs)
        out.append(ids)
    return out


def add_offline_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("offline", help="in-process engine throughput vs concurrency, per speculative setting")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--settings", default="none,dspark:fixed,dspark:adaptive",
                   help="comma-separated: none | METHOD[:fixed|adaptive][:K] (METHOD = dspark, mtp, ngram)")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (EOS ignored)")
    p.add_argument("--output-len-ratio", type=float, default=0.0, metavar="R",
                   help="draw each request's output length uniformly from [L (1 - R), L (1 + R)], L = --output-len "
                        "(the same lengths for every setting). With one fixed length plain decoding's requests end in "
                        "the same step and the next wave joins in one prefill: a lockstep that drafting breaks (its "
                        "requests accept different counts) and that real traffic does not have")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests per level = c x this")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="keep the last N prompt tokens (with "
                                                                        "--shared-prefix-tokens: of the question)")
    p.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="put one shared system prompt of about N tokens before every prompt (prefix caching's case)")
    p.add_argument("--dataset", action="append", help="JSONL prompt file(s) (default: the repository's "
                                                      "data/eval/*.jsonl, else the built-in prompts)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA / HIP graphs")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute every prompt from its first token (prefix caching is on by default)")
    p.add_argument("--sampling-scheme", choices=SAMPLING_SCHEMES, default=DEFAULT_SAMPLING_SCHEME,
                   help=SAMPLING_SCHEME_HELP)
    p.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false", default=None,
                   help=NO_ASYNC_SCHEDULING_HELP)
    p.add_argument("--profile-host", action="store_true",
                   help="time the engine's step pieces: host us per step / per request, device-busy fraction")
    p.add_argument("--calibrate-host", action="store_true",
                   help="time a fixed pure-Python workload before and after every level (rows' host_calib_us, in "
                        "us: lower is faster); on a shared host its speed moves, and tokens per second with it")
    p.add_argument("--no-freeze-gc", dest="freeze_gc", action="store_false",
                   help="leave the start-up heap in Python's cyclic collector (by default it is frozen once the engine "
                        "is built, as the server does: `engine.llm.freeze_startup_heap`)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every setting N times, the settings' order rotated each round; the table and JSON "
                        "results give each setting's best round (all rounds under meta.every_round), and each "
                        "setting over the best other setting of the same round, and over each other setting, "
                        "median [min, max] (meta.paired_ratios, its 'vs')")
    p.add_argument("--process-per-setting", action="store_true",
                   help="run each setting in a fresh process (its model loaded again): a setting's rows then do not "
                        "depend on the settings run before it")
    p.add_argument("--interleave", action="store_true",
                   help="build every setting's engine once in this process and run each concurrency level of every "
                        "setting back to back (with --rounds, the order rotated each round): ratios between settings "
                        "then compare runs seconds apart in one process")
    p.add_argument("--trace-budget", default=None, metavar="PATH",
                   help="write every decision of a drafting setting's budget (arm, why, the measured tokens per "
                        "second of each arm) and every step it timed (filed under an arm, or not and why), per "
                        "level, to this JSON file")
    p.add_argument("--json", default=None, help="write the results here (default: print only)")
    p.add_argument("--plot", default=None, help="PNG path for throughput vs concurrency")
    p.set_defaults(func=cmd_offline)
    return p


def run_isolated(args) -> list[dict]:
    """`run_offline` with each setting in a fresh process of its own (`--process-per-setting`), one after the
    other: no setting runs after another in the same process, so none sees what an earlier engine left there."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    rows = []
    ctx = multiprocessing.get_context("spawn")  # a new interpreter: nothing of this one's torch / CUDA state
    for text in args.settings.split(","):
        one = copy.copy(args)
        one.settings, one.process_per_setting, one.func = text, False, None
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            rows += pool.submit(run_offline, one).result()
    return rows


def run_rounds(args) -> tuple[list[dict], list[dict]]:
    """Every setting `--rounds` times; round r runs the settings in their order rotated by r, so each one runs
    early and late (on the H200 the same setting ran 20-30 % slower in a later process than in an earlier one:
    the machine drifts, not the engine). -> (per setting and concurrency, the round with the most tokens per
    second, in the order given; every row, each with its `round`)."""
    settings = args.settings.split(",")
    every: list[dict] = []
    if getattr(args, "interleave", False):
        every = run_interleaved(args)
    else:
        for r in range(args.rounds):
            one = copy.copy(args)
            one.settings = ",".join(settings[r % len(settings):] + settings[: r % len(settings)])
            got = run_isolated(one) if getattr(args, "process_per_setting", False) else run_offline(one)
            every += [row | {"round": r} for row in got]
    if args.rounds == 1:
        return every, every  # one round: every row as it ran (a setting given twice keeps both)
    order = {Setting.parse(text).label: i for i, text in reversed(list(enumerate(settings)))}
    best: dict[tuple[str, int], dict] = {}
    for row in every:
        key = (row["setting"], row["concurrency"])
        if key not in best or row["tok_s_total"] > best[key]["tok_s_total"]:
            best[key] = row
    return sorted(best.values(), key=lambda row: (order[row["setting"]], row["concurrency"])), every


def paired_ratios(every: list[dict]) -> list[dict]:
    """Each setting against the best other setting of the same round and concurrency, and (`vs`) against each other
    setting: tokens per second over the other's, per round, and their median, min and max over the rounds (a
    setting without a rival in a round is left out of it). Where two rivals tie, the best of them is the larger of
    two noisy draws, which reads a setting that runs exactly as one of them as behind; `vs` has no such lean.
    Best-of-N compares each setting's luckiest round; on the H200 one setting's rounds ran up to 1.5x apart within
    seconds, every host phase together, so a ratio of two best rounds moves with the luck of two draws.
    Rounds run back to back and the settings' order rotates (`--interleave`), so a round's ratio pairs levels run
    seconds apart. -> one row per setting and concurrency, in the order first seen."""
    import statistics

    def spread(r: list[float]) -> dict:
        return {"median": round(statistics.median(r), 3), "min": round(min(r), 3), "max": round(max(r), 3)}

    by_round: dict[tuple[int, int], dict[str, float]] = {}
    for row in every:
        by_round.setdefault((row["concurrency"], row.get("round", 0)), {})[row["setting"]] = row["tok_s_total"]
    ratios: dict[tuple[str, int], list[float]] = {}
    vs: dict[tuple[str, int], dict[str, list[float]]] = {}
    for row in every:
        key = (row["setting"], row["concurrency"])
        same = by_round[(row["concurrency"], row.get("round", 0))]
        others = {name: v for name, v in same.items() if name != row["setting"] and v > 0}
        if others:
            ratios.setdefault(key, []).append(row["tok_s_total"] / max(others.values()))
            for name, v in others.items():
                vs.setdefault(key, {}).setdefault(name, []).append(row["tok_s_total"] / v)
    return [{"setting": name, "concurrency": c, "rounds": len(r)} | spread(r)
            | {"vs": {other: spread(x) for other, x in vs[(name, c)].items()}} for (name, c), r in ratios.items()]


def format_ratios(ratios: list[dict], against: bool = False) -> str:
    """`paired_ratios` as a table, `median [min, max]` per concurrency: a row per setting (over the best other one
    of the same round), or with `against`, a row per pair of settings (one over the other, round by round)."""
    cs = sorted({r["concurrency"] for r in ratios})
    cell: dict[tuple[str, int], str] = {}
    for r in ratios:
        pairs = [(f"{r['setting']} / {other}", x) for other, x in r["vs"].items()] if against else [(r["setting"], r)]
        for label, x in pairs:
            cell[(label, r["concurrency"])] = f"{x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}]"
    names = list(dict.fromkeys(label for label, _ in cell))
    width = max(len(n) for n in names)
    lines = [" " * width + "".join(f"  {'c=' + str(c):>18}" for c in cs)]
    lines += [f"{n:>{width}}" + "".join(f"  {cell.get((n, c), '-'):>18}" for c in cs) for n in names]
    return "\n".join(lines)


def cmd_offline(args) -> int:
    if args.plot:
        require_plotting()
    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: expected at least 1")
    ratio = getattr(args, "output_len_ratio", 0.0)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--output-len-ratio {ratio}: expected 0 <= R < 1")
    if getattr(args, "interleave", False) and getattr(args, "process_per_setting", False):
        raise ValueError("--interleave runs every setting in one process: it cannot go with --process-per-setting")
    rows, every = run_rounds(args)
    traces = [{"setting": r["setting"], "concurrency": r["concurrency"], "round": r["round"],
               "events": r.pop("budget_trace")} for r in every if "budget_trace" in r]
    if getattr(args, "trace_budget", None):
        Path(args.trace_budget).write_text(json.dumps(traces))
        for t in traces:
            print(f"budget trace {t['setting']} c={t['concurrency']}"
                  + (f" round {t['round']}" if rounds > 1 else "") + f": {summarize_trace(t['events'])}",
                  file=sys.stderr)
    if rounds > 1:
        print(f"every round ({rounds}; the settings' order rotated each round):\n{format_table(every)}\n"
              f"best of {rounds} per setting and concurrency:", file=sys.stderr)
    print(format_table(rows))
    meta = {"kind": "offline", "model": str(args.model), "output_len": args.output_len,
            "output_len_ratio": getattr(args, "output_len_ratio", 0.0),
            "temperature": args.temperature, "profile_host": bool(args.profile_host),
            "freeze_gc": bool(getattr(args, "freeze_gc", False)),
            "enable_prefix_caching": args.enable_prefix_caching, "shared_prefix_tokens": args.shared_prefix_tokens,
            "sampling_scheme": args.sampling_scheme,
            "batch_invariant": bool(getattr(args, "batch_invariant", False)),
            "process_per_setting": bool(getattr(args, "process_per_setting", False)),
            "interleave": bool(getattr(args, "interleave", False)), "rounds": rounds,
            "requests_per_client": args.requests_per_client}
    if rounds > 1:
        meta["every_round"] = every  # `results` holds each setting's best round
        ratios = paired_ratios(every)
        if ratios:
            meta["paired_ratios"] = ratios
            print(f"each setting / the best other setting of the same round, median [min, max] over {rounds} rounds:"
                  f"\n{format_ratios(ratios)}", file=sys.stderr)
            # where two others tie, the best of them is the larger of two noisy draws, and the table above reads a
            # setting as that many % behind; one rival at a time has no such lean
            print(f"each setting / each other setting of the same round, median [min, max] over {rounds} rounds:"
                  f"\n{format_ratios(ratios, against=True)}", file=sys.stderr)
    if args.json:
        write_json(args.json, rows, meta)
    if args.plot:
        plot(rows, args.plot, title=f"offline, output {args.output_len} tokens")
    return 0
