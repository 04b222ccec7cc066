"""`sparkspec bench serve`: a load generator against a running `sparkspec serve` (or any OpenAI-compatible server).

Per concurrency level, `c` clients each send streaming `/v1/completions` requests back to back (closed loop, fixed
output length with `ignore_eos`). TTFT and TPOT come from the client's view of the SSE stream; tau from the
server's `/metrics` counters (verification steps and accepted draft tokens) when it exposes them. Run the server
once per speculative setting with `--label`, `--json` and `--append` to collect one line per setting, then
`--plot`."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

from sparkspec.bench.common import RequestTiming, format_table, plot, require_plotting, summarize, write_json
from sparkspec.bench.prompts import load_prompts

COUNTERS = ("sparkspec_spec_decode_num_drafts_total", "sparkspec_spec_decode_num_accepted_tokens_total",
            "sparkspec_spec_decode_num_draft_tokens_total")


async def scrape(client, base_url: str) -> dict[str, float]:
    import httpx

    try:
        text = (await client.get(base_url + "/metrics")).text
    except httpx.HTTPError:
        return {}  # a server without /metrics: no tau
    out = {}
    for name in COUNTERS:
        m = re.search(rf"^{name} ([0-9.eE+-]+)$", text, re.MULTILINE)
        if m:
            out[name] = float(m.group(1))
    return out


async def one_request(client, url: str, model: str, prompt: str, output_len: int, temperature: float
                      ) -> RequestTiming:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, n_tokens = None, 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                first = time.perf_counter()
    return RequestTiming(start, first, time.perf_counter(), n_tokens)


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                    output_len: int, temperature: float, label: str) -> dict:
    import httpx

    queue = list(range(num_requests))
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        before = await scrape(client, base_url)

        async def worker():
            while queue:
                i = queue.pop()
                timings.append(await one_request(client, base_url + "/v1/completions", model,
                                                 prompts[i % len(prompts)], output_len, temperature))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
        after = await scrape(client, base_url)
    delta = {k: int(after.get(k, 0) - before.get(k, 0)) for k in COUNTERS}
    spec = None
    if delta[COUNTERS[0]]:
        from sparkspec.spec_decode.metrics import SpecMetrics

        spec = SpecMetrics(label, 0, num_steps=delta[COUNTERS[0]], num_accepted_tokens=delta[COUNTERS[1]],
                           num_draft_tokens=delta[COUNTERS[2]])
    return summarize(label, concurrency, timings, duration, spec)


async def first_model(base_url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(base_url + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def add_serve_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="load generator against a running server: throughput vs concurrency")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--label", default="server", help="the speculative setting this server runs (a plot line)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--dataset", action="append", help="JSONL prompt file(s) (default: the repository's "
                                                      "data/eval/*.jsonl, else the built-in prompts)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", default=None, help="write the results here (default: print only)")
    p.add_argument("--append", action="store_true", help="add to the results already in --json")
    p.add_argument("--plot", default=None, help="PNG path; plots every row in --json (or this run's rows)")
    p.set_defaults(func=cmd_serve_bench)
    return p


def cmd_serve_bench(args) -> int:
    if args.append and not args.json:
        raise ValueError("--append: needs --json (the file to add the results to)")
    if args.plot:
        require_plotting()
    base = args.base_url.rstrip("/")
    model = args.model or asyncio.run(first_model(base))
    prompts = load_prompts(args.dataset or None, num=max(args.num_prompts, 1))
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        n = max(c * args.requests_per_client, args.min_requests)
        row = asyncio.run(run_level(base, model, prompts, c, n, args.output_len, args.temperature, args.label))
        rows.append(row)
        print(f"  {args.label:>20} c={c:<4} {row['tok_s_total']:8.1f} tok/s  tau={row['tau']:.2f}", file=sys.stderr)
    print(format_table(rows))
    if args.json:
        write_json(args.json, rows, {"kind": "serve", "base_url": base, "model": model,
                                     "output_len": args.output_len}, append=args.append)
    if args.plot:
        all_rows = json.loads(Path(args.json).read_text())["results"] if args.json else rows
        plot(all_rows, args.plot, title=f"serve, output {args.output_len} tokens")
    return 0
