"""A hostile load run against `sparkspec serve --spec dspark` on the demo pair (not a pytest test: no test_ prefix).

    python tests/hostile_run.py [--num-mutations 1800] [--concurrency 12] [--json out.json]
    python tests/hostile_run.py --base-url http://127.0.0.1:8000   # a running server that serves 'tiny'

Starts the server (or attaches to one), sends >= 2,000 hostile requests of every class the fuzz test knows
(tests/test_server_fuzz.py: the fixed table, seeded mutations — bad JSON, wrong types, unknown fields, bad
content types —, tiny temperatures with top_p / top_k edge values, raw surrogate bytes in every string field,
special-token text in messages, slow, stalled and chunked-2^64 bodies, slowloris heads, disconnects mid-body and
mid-stream) plus oversized bodies and huge n / max_tokens, while good streams run and are compared token for token
with their references, and /health is polled throughout. Prints a table of request class x status code (None:
closed without an answer) and the totals; exits 1 unless there is no 5xx, no corrupted good stream, no problem,
and /health stayed under 1 s."""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import test_server_fuzz as fuzz  # noqa: E402  (the case builders)
import test_server_qa as qa  # noqa: E402  (this session's cases, and the seeded streams of --sampling-scheme gumbel)
from test_server import free_port  # noqa: E402
from test_server_hygiene import exchange  # noqa: E402
from test_server_robustness import HealthWatch  # noqa: E402

from sparkspec.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HEALTH_LIMIT_S = 1.0


def extra_cases(url: str, port: int) -> list:
    """Oversized bodies and huge n / max_tokens (the fuzz test leaves them to test_server_robustness)."""
    def client():
        return httpx.Client(base_url=url, timeout=fuzz.SAFETY_S)

    big = json.dumps({"model": fuzz.MODEL, "prompt": "x" * (9 << 20)}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases = [("oversized body", fuzz.http_case(client, "POST", "/v1/completions", big, "application/json"))
             for _ in range(4)]
    cases += [("oversized body", fuzz.raw_case(port, [head + b"Content-Length: 99999999999\r\n\r\n"], {413, None}))
              for _ in range(4)]
    for field, value in [("n", 10**6), ("n", 2**63), ("max_tokens", 10**9), ("max_tokens", 2**63 - 1),
                         ("max_tokens", 10**30), ("n", -1)]:
        body = json.dumps({"model": fuzz.MODEL, "prompt": "x", field: value}).encode()
        cases += [("huge n / max_tokens", fuzz.http_case(client, "POST", "/v1/completions", body, "application/json"))
                  for _ in range(4)]
    return cases


def qa_cases(url: str, port: int, refs: dict) -> list:
    """This session's paths under load (tests/test_server_qa.py has each alone): bursts of 8 clients on one long
    prompt (prefix-cache hits) of whom 4 leave mid-stream, n = 4 on a shared prompt (greedy: every choice equals
    the n = 1 reference) and n = 4 left mid-stream or before its body, structured output that does not compile, is
    too long to compile, never finishes (ends at max_tokens) or is answered within its grammar, and forced tool
    calls on the demo's Jinja template (a 400 naming the field). `refs`: greedy references, from `qa_references`."""
    def client():
        return httpx.Client(base_url=url, timeout=fuzz.SAFETY_S)

    def stream_case(path, body, want):
        def run_():
            with client() as http:
                got = fuzz.stream_good(http, path, body)
            return 200, None if got == want else f"{path} {str(body)[:80]}: {repr(got)[:200]} != {repr(want)[:200]}"
        return run_

    def burst_case(path, body):
        def run_():
            leave = disconnect(path, {**body, "max_tokens": 400})
            got = qa.in_threads(*[lambda: stream_case(path, body, refs[path, "long"])()[1]] * 4, *[leave] * 4)
            return 200, next((p for p in got[:4] if p), None)
        return run_

    def disconnect(path, body):
        return lambda: fuzz.disconnect_mid_stream_case(url, path, body)()[1]

    cases = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        long_body = refs[path, "long body"]
        cases += [("prefix burst, 4 of 8 leave", burst_case(path, long_body)) for _ in range(6)]
        cases += [("n=4 greedy", stream_case(path, {**long_body, "n": 4}, {i: refs[path, "long"][0]
                                                                           for i in range(4)})) for _ in range(4)]
        cases += [("n=4 leaves mid-stream", fuzz.disconnect_mid_stream_case(url, path, {
            **long_body, "n": 4, "temperature": 1.0, "max_tokens": 400})) for _ in range(4)]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    body = json.dumps({"model": fuzz.MODEL, "prompt": qa.LONG_PROMPT, "n": 4, "max_tokens": 400,
                       "ignore_eos": True}).encode()

    def leave_before_answer():  # the whole request, then gone: the server finds out while the samples run
        exchange(port, head + b"Content-Length: %d\r\n\r\n" % len(body), body, close_after=True)
        return None, None
    cases += [("n=4 leaves before its answer", leave_before_answer) for _ in range(4)]
    bad = [{"regex": "("}, {"regex": "[a-"}, {"grammar": "root ::= "}, {"grammar": "root ::= undefined_rule"},
           {"choice": [f"option {i}" for i in range(20_000)]}, {"choice": [f"o{i}" for i in range(5000)]},
           {"choice": ["x" * 70_000]}, {"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}]
    for so in bad:
        field = "structured_outputs." + ("json" if "json" in so else next(iter(so)))

        def check(r, field=field):
            param = r.json()["error"]["param"] if r.status_code == 400 else None
            return None if param in (field, "response_format.json_schema.schema") else f"{r.status_code} {r.text[:200]}"
        raw = json.dumps({"model": fuzz.MODEL, "prompt": "x", "max_tokens": 2, "structured_outputs": so}).encode()
        cases += [("structured, does not compile", fuzz.http_case(client, "POST", "/v1/completions", raw,
                                                                  "application/json", check)) for _ in range(2)]
    never = {"prompt": "a", "max_tokens": 12, "temperature": 1.0,
             "structured_outputs": {"grammar": 'root ::= "a" root'}}

    def check_never(r):
        c = r.json()["choices"][0] if r.status_code == 200 else {}
        ok = c.get("finish_reason") == "length" and c.get("text") and set(c["text"]) == {"a"}
        return None if ok else f"never-finishing grammar: {r.status_code} {r.text[:200]}"
    choices = [f"option {i}" for i in range(300)]

    def check_choice(r):
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
        return None if text in choices else f"choice: {r.status_code} {r.text[:200]}"
    for _ in range(6):
        cases.append(("structured, never finishes", fuzz.http_case(client, "POST", "/v1/completions", json.dumps(
            {"model": fuzz.MODEL, **never}).encode(), "application/json", check_never)))
        cases.append(("structured, never finishes", fuzz.disconnect_mid_stream_case(url, "/v1/completions", {
            **never, "max_tokens": 400})))
        cases.append(("structured, 300 choices", fuzz.http_case(client, "POST", "/v1/completions", json.dumps(
            {"model": fuzz.MODEL, "prompt": "pick", "max_tokens": 16, "temperature": 1.0,
             "structured_outputs": {"choice": choices}}).encode(), "application/json", check_choice)))
    forced = [({"tools": qa.TOOLS, "tool_choice": "required"}, "tools"),
              ({"tools": qa.TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tools"),
              ({"tool_choice": "required"}, "tool_choice"),
              ({"tools": qa.TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
               "tool_choice.function.name")]
    for fields, param in forced:
        def check(r, param=param):
            got = r.json()["error"]["param"] if r.status_code == 400 else None
            return None if got == param else f"forced tool call: {r.status_code} {r.text[:200]}"
        for stream in (False, True):
            raw = json.dumps({"model": fuzz.MODEL, "messages": [{"role": "user", "content": "weather?"}],
                              "max_tokens": 8, "stream": stream, **fields}).encode()
            cases.append(("forced tool_choice (Jinja)", fuzz.http_case(client, "POST", "/v1/chat/completions", raw,
                                                                       "application/json", check)))
    return cases


def qa_references(http: httpx.Client) -> dict:
    """The greedy long-prompt answers `qa_cases` compares with, on the idle server."""
    refs = {}
    for path, prompt in (("/v1/completions", {"prompt": qa.LONG_PROMPT}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": qa.LONG_PROMPT}]})):
        refs[path, "long body"] = body = {**prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        refs[path, "long"] = fuzz.stream_good(http, path, body)
    return refs


def start_server(port: int, sampling_scheme: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "sparkspec.serve.cli", "--model", str(ROOT / fuzz.DEMO), "--spec", "dspark",
           "--port", str(port), "--served-model-name", fuzz.MODEL, "--log-level", "warning",
           "--timeout-header", "5", "--timeout-body", "5", "--max-num-seqs", "32", "--max-waiting", "512",
           "--sampling-scheme", sampling_scheme]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit("the server did not come up within 300 s")
        time.sleep(0.2)


def run(url: str, num_mutations: int, concurrency: int, num_good_threads: int, sampling_scheme: str) -> dict:
    port = httpx.URL(url).port
    tokenizer = Tokenizer.from_dir(ROOT / fuzz.DEMO)
    # under Gumbel a seeded sampled stream is reproducible whatever the batch and the drafts: it joins the good ones
    good_requests = fuzz.GOOD + (qa.SEEDED if sampling_scheme == "gumbel" else [])
    with httpx.Client(base_url=url, timeout=fuzz.SAFETY_S) as http:
        references = [fuzz.stream_good(http, path, body) for path, body in good_requests]
        refs = qa_references(http)
        greedy = {}
        for path, prompt in (("/v1/completions", {"prompt": "Hello"}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
            c = http.post(path, json={"model": fuzz.MODEL, **prompt, "max_tokens": 8, "temperature": 0}).json()
            c = c["choices"][0]
            greedy[path] = c.get("text", (c.get("message") or {}).get("content"))
    fuzz.NUM_MUTATIONS = num_mutations
    cases = fuzz.hostile_cases(SimpleNamespace(url=url, port=port), tokenizer, greedy) + extra_cases(url, port) \
        + qa_cases(url, port, refs)
    fuzz.random.Random(1).shuffle(cases)
    done, good, corrupted = threading.Event(), collections.Counter(), []

    def run_good(offset: int):
        with httpx.Client(base_url=url, timeout=fuzz.SAFETY_S) as http:
            i = offset
            while not done.is_set():
                path, body = good_requests[i % len(good_requests)]
                try:
                    got = fuzz.stream_good(http, path, body)
                except (AssertionError, httpx.HTTPError) as e:
                    got = f"broken stream: {e!r}"
                if got != references[i % len(good_requests)]:
                    corrupted.append({"request": i % len(good_requests), "got": repr(got)[:500]})
                good[offset] += 1
                i += 1

    def guarded(case):
        try:
            return case()
        except Exception as e:  # the client side of a case broke: report it, never hide it
            return "client error", f"{type(e).__name__}: {e}"

    table, problems = collections.defaultdict(collections.Counter), []
    start = time.perf_counter()
    with HealthWatch(url) as health:
        threads = [threading.Thread(target=run_good, args=(j,), daemon=True) for j in range(num_good_threads)]
        for t in threads:
            t.start()
        with ThreadPoolExecutor(concurrency) as pool:
            for (kind, _), (status, problem) in zip(cases, pool.map(lambda c: guarded(c[1]), cases)):
                table[kind][str(status)] += 1
                if problem:
                    problems.append({"class": kind, "problem": problem[:500]})
        done.set()
        for t in threads:
            t.join(fuzz.SAFETY_S)
    elapsed = time.perf_counter() - start
    metrics = httpx.get(url + "/metrics", timeout=fuzz.SAFETY_S).text
    counted = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
               if line.startswith(("sparkspec_http_errors_total", "sparkspec_requests_total"))}
    num_5xx = sum(n for counts in table.values() for s, n in counts.items() if s.isdigit() and int(s) >= 500)
    return {"num_requests": len(cases), "seconds": round(elapsed, 1), "table": {k: dict(v) for k, v in table.items()},
            "num_5xx": num_5xx, "num_good_streams": sum(good.values()), "num_corrupted_good_streams": len(corrupted),
            "corrupted": corrupted[:10], "problems": problems[:50], "num_problems": len(problems),
            "health_polls": health.n, "health_non_200": len(health.bad), "health_max_latency_s": round(health.worst, 3),
            "metrics": counted}


def print_table(result: dict) -> None:
    statuses = sorted({s for counts in result["table"].values() for s in counts}, key=lambda s: (not s.isdigit(), s))
    width = max(len(k) for k in result["table"]) + 2
    print("class".ljust(width) + "".join(s.rjust(7) for s in statuses) + "  total".rjust(8))
    for kind, counts in sorted(result["table"].items()):
        print(kind.ljust(width) + "".join(str(counts.get(s, "")).rjust(7) for s in statuses)
              + str(sum(counts.values())).rjust(8))
    print(f"\n{result['num_requests']} hostile requests in {result['seconds']} s; 5xx: {result['num_5xx']}; problems: "
          f"{result['num_problems']}; good streams: {result['num_good_streams']}, corrupted: "
          f"{result['num_corrupted_good_streams']}; /health: {result['health_polls']} polls, "
          f"{result['health_non_200']} not 200, max latency {result['health_max_latency_s'] * 1000:.0f} ms")
    print("server counters: " + ", ".join(f"{k} = {v:g}" for k, v in sorted(result["metrics"].items())))
    for p in result["problems"][:10]:
        print(f"  problem [{p['class']}]: {p['problem']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="attach to this server (it must serve the name 'tiny')")
    p.add_argument("--num-mutations", type=int, default=1800, help="seeded mutations of good requests")
    p.add_argument("--concurrency", type=int, default=12, help="hostile requests in flight at once")
    p.add_argument("--good-threads", type=int, default=2, help="clients resending the 8 good streams")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--sampling-scheme", choices=["rejection", "gumbel"], default="rejection",
                   help="the server's (started with it, or, with --base-url, what it runs): gumbel adds seeded "
                        "sampled streams to the good ones")
    args = p.parse_args(argv)
    proc = None
    if args.base_url is None:
        port = free_port()
        proc = start_server(port, args.sampling_scheme)
        url = f"http://127.0.0.1:{port}"
    else:
        url = args.base_url.rstrip("/")
    try:
        result = run(url, args.num_mutations, args.concurrency, args.good_threads, args.sampling_scheme)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    ok = (result["num_requests"] >= 2000 and not result["num_5xx"] and not result["num_corrupted_good_streams"]
          and not result["num_problems"] and not result["health_non_200"]
          and result["health_max_latency_s"] < HEALTH_LIMIT_S)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
