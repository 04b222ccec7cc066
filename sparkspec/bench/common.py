"""Benchmark bookkeeping shared by `bench offline` and `bench serve`: per-request timings, the summary row,
the printed table, JSON and the throughput-vs-concurrency plot; and `sync`, the device wait of every timer.

Definitions (per concurrency level, one speculative setting):
  * tok/s total     output tokens of all requests / wall time of the level
  * tok/s per user  mean over requests of (output tokens - 1) / (finish - first token) = 1 / TPOT of the request
  * TTFT            request sent -> first token;  TPOT  (finish - first token) / (output tokens - 1)
  * tau             tokens per verification step, pooled over the level's requests (1.0 without speculation);
                    the definition is `sparkspec.spec_decode.metrics`'s, as everywhere else
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def sync(device) -> None:
    """Wait for `device` (a torch.device) to finish its queued work, so that a timer reads the work's end."""
    if device.type != "cpu":
        import torch

        torch.accelerator.synchronize(device)


@dataclass
class RequestTiming:
    start: float
    first_token: float | None
    finish: float
    num_output_tokens: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.num_output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.num_output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(label: str, concurrency: int, timings: list[RequestTiming], duration: float, spec=None) -> dict:
    """One row of the table; `spec`: the level's pooled `SpecMetrics` (None without speculation)."""
    tokens = sum(t.num_output_tokens for t in timings)
    ttft = [t.ttft for t in timings if t.ttft is not None]
    tpot = [t.tpot for t in timings if t.tpot is not None]
    per_user = [1.0 / x for x in tpot if x > 0]
    return {
        "setting": label, "concurrency": concurrency, "num_requests": len(timings), "duration_s": round(duration, 3),
        "output_tokens": tokens,
        "tok_s_total": round(tokens / duration, 2) if duration > 0 else 0.0,
        "tok_s_per_user": round(sum(per_user) / len(per_user), 2) if per_user else 0.0,
        "ttft_ms_p50": round(1000 * percentile(ttft, 50), 2), "ttft_ms_p99": round(1000 * percentile(ttft, 99), 2),
        "tpot_ms_p50": round(1000 * percentile(tpot, 50), 2), "tpot_ms_p99": round(1000 * percentile(tpot, 99), 2),
        "tau": round(spec.acceptance_length, 3) if spec is not None else 1.0,
        "spec_steps": spec.num_steps if spec is not None else 0,
        "drafted": spec.num_draft_tokens if spec is not None else 0,
        "accepted": spec.num_accepted_tokens if spec is not None else 0,
    }


COLUMNS = [("setting", "setting", "{}"), ("concurrency", "conc", "{}"), ("tok_s_total", "tok/s", "{:.1f}"),
           ("tok_s_per_user", "tok/s/user", "{:.1f}"), ("ttft_ms_p50", "TTFT p50", "{:.1f}"),
           ("ttft_ms_p99", "TTFT p99", "{:.1f}"), ("tpot_ms_p50", "TPOT p50", "{:.1f}"),
           ("tpot_ms_p99", "TPOT p99", "{:.1f}"), ("tau", "tau", "{:.2f}")]


# `bench offline --profile-host` (`sparkspec.bench.host_profile`): shown where every row has them
PROFILE_COLUMNS = [("host_us_per_step", "host us/step", "{:.0f}"), ("host_us_per_req", "host us/req", "{:.1f}"),
                   ("device_wait_frac", "dev wait", "{:.2f}"), ("device_busy_frac", "dev busy", "{:.2f}"),
                   ("graph_replays_per_step", "graphs/step", "{:.2f}"),
                   ("eager_forwards_per_step", "eager/step", "{:.2f}"),
                   ("eager_us_per_step", "eager us/step", "{:.0f}"), ("gc_us_per_step", "gc us/step", "{:.0f}")]


def table_head(names) -> str:
    """A markdown table's header line and rule."""
    names = list(names)
    return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


def table_row(cells) -> str:
    """One markdown table row (cells shown with str)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def format_table(rows: list[dict]) -> str:
    """A markdown table (times in ms; host columns in us)."""
    columns = COLUMNS + [c for c in PROFILE_COLUMNS if rows and all(c[0] in r for r in rows)]
    lines = [table_head(h for _, h, _ in columns)]
    lines += [table_row(fmt.format(r[k]) for k, _, fmt in columns) for r in rows]
    return "\n".join(lines)


def write_json(path: str | Path, rows: list[dict], meta: dict, append: bool = False) -> None:
    path = Path(path)
    old = []
    if append and path.is_file():
        old = json.loads(path.read_text()).get("results", [])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": old + rows}, indent=2) + "\n")


def require_plotting() -> None:
    """Called before a `--plot` run starts: a missing matplotlib fails in a second (exit 2, naming the `bench`
    extra through the CLI's ModuleNotFoundError handler), not after the whole benchmark has run."""
    import matplotlib  # noqa: F401


def plot(rows: list[dict], path: str | Path, title: str = "throughput vs concurrency") -> None:
    """PNG: total output tok/s vs concurrency, one line per setting (log-2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for setting in dict.fromkeys(r["setting"] for r in rows):
        pts = sorted((r["concurrency"], r["tok_s_total"]) for r in rows if r["setting"] == setting)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=setting)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s (total)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
