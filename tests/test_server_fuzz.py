"""Fuzz the live server: a fixed table of hostile requests plus seeded random mutations of good ones (over 500
in all, bounded: the test takes well under a minute on 2 cores), sent while good streams run. No answer may be
a 5xx, every error must be OpenAI-shaped JSON, every good stream must complete intact, and /health must answer
200 within a second throughout. Seeded `random`, not hypothesis: the same requests on every run."""

from __future__ import annotations

import collections
import json
import random
import threading
import time

import httpx
import pytest
from test_server import Server
from test_server_robustness import HealthWatch, sse_events

from sparkspec.checkpoint import load_checkpoint
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine

MODEL = "tiny"
NUM_MUTATIONS = 800
GOOD_TOKENS = 24

COMPLETION = {"model": MODEL, "prompt": "fuzz", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 2}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "ignore_eos", "user", "store", "metadata", "service_tier",
          "parallel_tool_calls", "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "logit_bias", "echo", "best_of", "suffix", "tools", "tool_choice", "response_format", "\ud800", "",
          "__proto__", "x" * 300]
VALUES = [None, True, False, 0, 1, -1, 2, 3, 95, 96, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1,
          10**40, 0.5, -0.5, 1e-300, 5e-324, 1e308, -1e308, float("nan"), float("inf"), "", "x", "tiny", "\ud800",
          "\udfff\ud800", "\x00", "\ufffd" * 50, "é" * 3000, "s" * 1001, [], [[]], [1, 2], [-1], [96], [2**64],
          ["a"] * 5, ["", "b"], ["a", 1], [{"role": "user", "content": "x"}], [{"role": "tool", "content": "x"}],
          [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
          [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
          [{"role": "user"}], [{"content": "x"}], {}, {"a": "b"}, {"a": 1}, {"include_usage": True},
          {"include_usage": "yes"}, {"type": "json_object"}, {"type": "text"}, [[[[[[[[[[1]]]]]]]]]]]
TABLE = [  # (method, path, content, content-type)
    ("POST", "/v1/completions", b"", "application/json"),
    ("POST", "/v1/completions", b"null", "application/json"),
    ("POST", "/v1/completions", b"[]", "application/json"),
    ("POST", "/v1/completions", b'"a string"', "application/json"),
    ("POST", "/v1/completions", b"1e999", "application/json"),
    ("POST", "/v1/completions", b"\xff\xfe{}", "application/json"),
    ("POST", "/v1/completions", b'\xef\xbb\xbf{"model": "tiny", "prompt": "x"}', "application/json"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xc3\x28"}', "application/json"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "prompt": 5}', "application/json"),
    ("POST", "/v1/completions", b"[" * 100_000, "application/json"),
    ("POST", "/v1/completions", b'{"a":' * 3000 + b"1" + b"}" * 3000, "application/json"),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "application/json"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x"}', "text/plain"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x"}', "multipart/form-data; boundary=x"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x"}', "application/json; charset=latin-1"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x"}', "application/problem+json"),
    ("POST", "/v1/completions", b"model=tiny", "application/x-www-form-urlencoded"),
    ("GET", "/v1/completions", b"", None),
    ("PUT", "/v1/chat/completions", b"{}", "application/json"),
    ("DELETE", "/v1/models", b"", None),
    ("POST", "/health", b"{}", "application/json"),
    ("POST", "/v1/embeddings", b"{}", "application/json"),
    ("GET", "/v1/../../etc/passwd", b"", None),
    ("GET", "/%ff%fe", b"", None),
    ("GET", "/v1/models/" + "a" * 4000, b"", None),
]


def mutations(rng: random.Random):
    """Good bodies with 1-3 fields replaced, removed or added, or their JSON text damaged."""
    for _ in range(NUM_MUTATIONS):
        path, base = rng.choice([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
        body = json.loads(json.dumps(base))
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(FIELDS)
            if rng.random() < 0.15:
                body.pop(key, None)
            else:
                body[key] = rng.choice(VALUES)
        if body.get("max_tokens") not in (None, 1, 2, 3) and isinstance(body.get("max_tokens"), int) \
                and 0 < body["max_tokens"] < 2048:
            body["max_tokens"] = 2  # keep accidental valid requests short
        raw = json.dumps(body).encode()
        kind = rng.random()
        if kind < 0.1:
            raw = raw[: rng.randrange(len(raw))]  # truncated
        elif kind < 0.2:
            i = rng.randrange(len(raw))
            raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1 :]  # one byte changed
        yield "POST", path, raw, "application/json"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint)
    engine = LLMEngine(ckpt.model, ckpt.tokenizer, EngineConfig(max_num_seqs=16, speculative="none"))
    with Server(engine) as s:
        yield s


def test_fuzz_requests_while_a_good_stream_runs(server):
    requests = TABLE + list(mutations(random.Random(0)))
    assert len(requests) >= 500
    done, good, problems = threading.Event(), [], []

    def run_good():  # one good stream after another until the fuzzing is over; each must be intact
        body = {"model": MODEL, "prompt": "a good stream", "max_tokens": GOOD_TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            while not done.is_set() or not good:
                with http.stream("POST", "/v1/completions", json=body) as r:
                    good.append((r.status_code, sse_events(r)))

    statuses = collections.Counter()
    start = time.perf_counter()
    with HealthWatch(server.url) as health:
        t = threading.Thread(target=run_good)
        t.start()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for method, path, content, ctype in requests:
                headers = {"content-type": ctype} if ctype else {}
                r = http.request(method, path, content=content or None, headers=headers)
                statuses[r.status_code] += 1
                if r.status_code >= 500:
                    problems.append((method, path, content[:200], r.status_code, r.text[:300]))
                elif r.status_code >= 400 and not r.json().get("error", {}).get("message"):
                    problems.append((method, path, content[:200], r.status_code, "not OpenAI-shaped: " + r.text))
        done.set()
        t.join(60)
    elapsed = time.perf_counter() - start
    print(f"\n{len(requests)} fuzz requests in {elapsed:.1f} s: {dict(sorted(statuses.items()))}; "
          f"{len(good)} good streams; /health worst {health.worst * 1000:.0f} ms over {health.n} polls")
    assert not problems, problems[:5]
    assert not health.bad and health.worst < 1.0, (health.bad[:5], health.worst)
    for status, events in good:
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        assert not any("error" in e for e in events[:-1]), events
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["usage"]["completion_tokens"] == GOOD_TOKENS
    assert server.app.state.engine.is_running
