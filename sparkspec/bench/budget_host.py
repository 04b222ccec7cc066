"""`sparkspec bench budget`: the adaptive budget's host time a step, without a model or a device. The budget is
driven as the engine drives it (`SpecPolicy`: open the step, decide k, tell what the step does and what it
produced) on a fake clock, with the H200 demo pair's step costs, and each call is timed on this host:

- warm: steps back to back, the budget's code and data in the caches (a lower bound);
- cold: between two steps a buffer larger than the caches is copied and some unrelated Python runs, as the model's
  step does inside an engine. On a 2-core CPU this reproduced the budget's cost inside a c = 1 engine (24-26 us a
  step, against ~4 warm), in seconds and within ~0.5 us from run to run.

Per workload, with the budget's coasting on and off (`VerificationBudget.coast`): us a step in each call, the
decisions made in full (those that read the model), and the share of steps that draft. The decisions depend on the
fake clock alone, so they are the same on every machine; the times are this host's. Prints the table; writes JSON
where `--json` says."""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass

import numpy as np

from sparkspec.bench.common import table_head, table_row, write_json


@dataclass(frozen=True)
class Workload:
    """Steady steps of `reqs` requests: a plain step takes `plain_s`, a drafting one `spec_s` and produces
    `spec_tokens` (a plain one, one token a request)."""

    name: str
    reqs: int
    plain_s: float
    spec_s: float
    spec_tokens: float


# the H200 demo pair (bf16, graphs, async scheduling): at c = 1 plain decoding wins, at c = 16 drafting can
WORKLOADS = {
    "c1-plain": Workload("c1-plain", 1, 0.00066, 0.00215, 2.76),
    "c16-spec": Workload("c16-spec", 16, 0.0012, 0.0022, 60.0),
}
CALLS = ("step_boundary", "next_num_drafts", "note_step", "note_tokens")


class FakeClock:
    """The budget's clock: the bench moves it by each step's modelled seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_budget(clock: FakeClock, coast: bool, num_spec_tokens: int = 7):
    """A budget as a demo-pair engine with graphs and async scheduling builds it (`SpecPolicy.start`), on a cost table
    that says draft at every request count (the measured arms decide), with an acceptance estimate of ~2 drafts."""
    from sparkspec.engine.budget import VerificationBudget
    from sparkspec.engine.cost_table import CostTable

    k = num_spec_tokens
    table = CostTable({r: [(r, 0.001), (r * (1 + k), 0.001)] for r in (1, 4, 16, 64, 256)},
                      [(r, 0.0001) for r in (1, 4, 16, 64, 256)])
    budget = VerificationBudget("adaptive", k, table, padded=True, clock=clock, plain_probe_extra=2,
                                context_window=64, coast=coast)
    for _ in range(300):
        budget.observe(k, 2)
    return budget


class Evictor:
    """Leaves the caches cold: copies a buffer of `megabytes` and serialises some unrelated data."""

    def __init__(self, megabytes: int = 16, seed: int = 0):
        self.src = np.ones(megabytes << 18, dtype=np.float32)
        self.dst = np.empty_like(self.src)
        rng = np.random.default_rng(seed)
        self.junk = [{"a": float(x), "b": [float(y) for y in rng.random(8)], "c": str(i)}
                     for i, x in enumerate(rng.random(2000))]
        self.turn = 0

    def __call__(self) -> None:
        np.copyto(self.dst, self.src)
        self.turn = (self.turn + 97) % 1700
        json.dumps(self.junk[self.turn: self.turn + 300])


def run_one(work: Workload, coast: bool, cold: bool, steps: int, warmup: int, evict: Evictor | None) -> dict:
    """`warmup` steps untimed, then `steps` timed -> the row."""
    clock = FakeClock()
    budget = make_budget(clock, coast)
    full = [0]
    model = budget._model

    def counted(*a, **kw):
        full[0] += 1
        return model(*a, **kw)

    budget._model = counted
    r, pc = work.reqs, time.perf_counter
    spent = [0.0] * len(CALLS)
    proposed = drafting_steps = 0
    for n in range(warmup + steps):
        if n == warmup:
            full[0], spent, drafting_steps = 0, [0.0] * len(CALLS), 0
        if cold:
            evict()
        t0 = pc()
        budget.step_boundary()
        t1 = pc()
        verified = sum(budget.lengths([proposed] * r, [None] * r, r, r)) if proposed else 0  # (untimed: `choose`)
        t1b = pc()
        k = budget.next_num_drafts(r, r, r, False)
        t2 = pc()
        budget.note_step(r, verified, k, False, 0, 0, r)
        t3 = pc()
        drafting = verified > 0 or k > 0
        clock.now += work.spec_s if drafting else work.plain_s
        t4 = pc()
        budget.note_tokens(round(work.spec_tokens) if drafting else r)
        t5 = pc()
        spent[0] += t1 - t0
        spent[1] += t2 - t1b
        spent[2] += t3 - t2
        spent[3] += t5 - t4
        for _ in range(r if verified else 0):
            budget.observe(verified // r, min(verified // r, 2))
        drafting_steps += drafting
        proposed = k
    per_step = {c: round(1e6 * s / steps, 2) for c, s in zip(CALLS, spent)}
    return {"workload": work.name, "coast": "on" if coast else "off", "caches": "cold" if cold else "warm",
            "steps": steps,
            **{f"{c}_us": v for c, v in per_step.items()}, "total_us": round(sum(per_step.values()), 2),
            "full_decisions": full[0], "drafting_share": round(drafting_steps / steps, 4)}


def run(args) -> list[dict]:
    evict = Evictor(args.evict_mb)
    rows = []
    for rnd in range(args.rounds):
        for name in args.workloads:
            for coast in args.coast:
                for cold in args.caches:
                    row = run_one(WORKLOADS[name], coast, cold, args.steps, args.warmup, evict)
                    rows.append(row | {"round": rnd})
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """One row per (workload, coast, caches): the median of the rounds' times (decisions are the same in each)."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["workload"], r["coast"], r["caches"]), []).append(r)
    res = []
    for group in out.values():
        row = dict(group[0])
        row.pop("round")
        for key in [f"{c}_us" for c in CALLS] + ["total_us"]:
            vals = sorted(g[key] for g in group)
            row[key] = vals[len(vals) // 2]
        res.append(row | {"rounds": len(group)})
    return res


def add_budget_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("budget", help="the adaptive budget's host time a step (no model, no device)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--coast", default="on,off", help="the budget's coasting: on, off or both (on,off)")
    p.add_argument("--caches", default="warm,cold", help="warm, cold or both (warm,cold)")
    p.add_argument("--steps", type=int, default=4000, help="timed steps a run")
    p.add_argument("--warmup", type=int, default=2000, help="untimed steps before them (the arms get measured)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each; the table gives their median")
    p.add_argument("--evict-mb", type=int, default=16, help="the buffer copied between steps where caches are cold")
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)
    return p


def parse_choices(value: str, field: str, choices: dict) -> list:
    """A comma-separated flag -> its values (a ValueError naming the flag: `sparkspec` exits 2 with it)."""
    out = []
    for v in value.split(","):
        if v not in choices:
            raise ValueError(f"bench budget: {field} {v!r}: expected one of {', '.join(choices)}")
        out.append(choices[v])
    return out


def main(args) -> int:
    args.workloads = parse_choices(args.workloads, "--workloads", {w: w for w in WORKLOADS})
    args.coast = parse_choices(args.coast, "--coast", {"on": True, "off": False})
    args.caches = parse_choices(args.caches, "--caches", {"warm": False, "cold": True})
    for field in ("steps", "warmup", "rounds", "evict_mb"):
        if getattr(args, field) < (0 if field == "warmup" else 1):
            raise ValueError(f"bench budget: --{field.replace('_', '-')} {getattr(args, field)}: too small")
    rows = medians(run(args))
    cols = ["workload", "coast", "caches"] + [f"{c}_us" for c in CALLS] + ["total_us", "full_decisions",
                                                                           "drafting_share"]
    print(table_head(cols))
    for r in rows:
        print(table_row(r[c] for c in cols))
    if args.json:
        write_json(args.json, rows, {"kind": "budget", "steps": args.steps, "warmup": args.warmup,
                                     "rounds": args.rounds, "evict_mb": args.evict_mb,
                                     "host": platform.processor() or platform.machine()})
    return 0
