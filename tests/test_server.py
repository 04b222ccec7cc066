"""The OpenAI-compatible server, driven by the real `openai` client against uvicorn on a free port (in-process)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from sparkspec.engine.async_engine import AsyncLLMEngine
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.loading.checkpoint import load_checkpoint
from sparkspec.sampling_params import SamplingParams
from sparkspec.serve.api import create_app
from sparkspec.serve.connections import ConnectionLimits, uvicorn_config

MODEL = "tiny"
DEFAULT_LIMITS = ConnectionLimits()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`engine` served in a thread through the guarded protocol (`serve.connections`), with `limits`."""

    def __init__(self, engine: LLMEngine, limits: ConnectionLimits = DEFAULT_LIMITS, model: str = MODEL):
        self.engine = engine
        self.port = free_port()
        self.app = create_app(AsyncLLMEngine(engine), model, default_max_tokens=8)
        self.server = uvicorn.Server(uvicorn_config(self.app, limits, self.app.state.count_refused, host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(tiny_checkpoint_with_drafters, tmp_path_factory):
    """DSpark with the adaptive budget: every test below also checks speculation through the server."""
    ckpt = load_checkpoint(tiny_checkpoint_with_drafters)
    config = EngineConfig(max_num_seqs=64, max_waiting=256, speculative="dspark", spec_budget="adaptive",
                          cost_cache_dir=str(tmp_path_factory.mktemp("costs")))
    engine = LLMEngine(ckpt.model, ckpt.tokenizer, config, ckpt.drafter_tensors)
    with Server(engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def wait_idle(engine: LLMEngine, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while engine.has_unfinished() or engine.kv_usage > 0:
        assert time.time() < deadline, \
            f"engine not idle: running={engine.scheduler.num_running} usage={engine.kv_usage}"
        time.sleep(0.02)


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0, extra_body={
        "ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert isinstance(r.choices[0].text, str)


def test_completion_matches_offline_engine(client, server):
    prompt_ids = [0, 17, 99, 250, 7]
    r = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    plain = LLMEngine(server.engine.model, server.engine.tokenizer, EngineConfig())  # no speculation
    ref = plain.generate([prompt_ids], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert r.choices[0].text == ref.text


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "Hi!"}], max_tokens=5)
    assert r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage.completion_tokens <= 5


def test_streaming_completion_and_chat(client, server):
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Hi"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    greedy = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    plain = LLMEngine(server.engine.model, server.engine.tokenizer, EngineConfig())  # no speculation
    ref = plain.generate([server.engine.tokenizer.encode_chat(messages)], SamplingParams(max_tokens=6,
                                                                                          ignore_eos=True))[0]
    assert text == greedy == full.choices[0].message.content == ref.text  # streamed chunks add up to the reply


def test_64_concurrent_streams(server):
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await c.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True})
        finish, n = None, 0
        async for ch in stream:
            n += 1
            finish = ch.choices[0].finish_reason or finish
        return finish, n

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=100))) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(main())
    assert [f for f, _ in results] == ["length"] * 64
    wait_idle(server.engine)


BAD_REQUESTS = [  # (name, path, raw body or JSON, expected status)
    ("invalid json", "/v1/completions", b"{not json", 400),
    ("body not an object", "/v1/completions", [1, 2], 400),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 400),
    ("unknown field", "/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400),
    ("n too large", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400),
    ("logprobs too large", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 6}, 400),
    ("unsupported best_of", "/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, 400),
    ("speculative not an object", "/v1/completions", {"model": MODEL, "prompt": "x", "speculative": 2}, 400),
    ("unsupported penalty", "/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400),
    ("max_tokens zero", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ("max_tokens over context", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400),
    ("max_tokens string", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400),
    ("temperature negative", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.1}, 400),
    ("temperature bool", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": True}, 400),
    ("top_p zero", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400),
    ("top_p above one", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("token id out of vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400),
    ("two prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400),
    ("stop not strings", "/v1/completions", {"model": MODEL, "prompt": "x", "stop": [1]}, 400),
    ("chat no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("chat bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     400),
    ("chat tools", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                            "tools": [{"type": "function"}]}, 400),
    ("chat content not text", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, 400),
    ("seed above uint64", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 4, "seed": 2**64}, 400),
    ("seed below int64", "/v1/completions", {"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}, 400),
    ("top_k above int64", "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**63}, 400),
    ("lone surrogate", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    ("lone surrogate key", "/v1/completions", b'{"model": "tiny", "prompt": "x", "\\udfff": 1}', 400),
    ("nested 5000 deep", "/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("nested 40 deep", "/v1/completions",
     b'{"model": "tiny", "prompt": "x", "metadata": ' + b'{"a": ' * 40 + b"1" + b"}" * 41, 400),
    ("NaN", "/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400),
    ("integer of 5000 digits", "/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000
     + b"}", 400),
    ("stop string too long", "/v1/completions", {"model": MODEL, "prompt": "x", "stop": "s" * 1001}, 400),
    ("five stop strings", "/v1/completions", {"model": MODEL, "prompt": "x", "stop": list("abcde")}, 400),
    ("form content type", "/v1/completions", (b"model=tiny&prompt=x", "application/x-www-form-urlencoded"), 415),
    ("text content type", "/v1/completions", (b'{"model": "tiny", "prompt": "x"}', "text/plain"), 415),
    ("wrong method", "/v1/models", None, 405),
    ("unknown route", "/v1/embeddings", {"model": MODEL, "input": "x"}, 404),
]


def test_bad_requests_get_4xx_while_a_good_request_succeeds(server, client):
    good: dict = {}

    def run_good():
        stream = client.completions.create(model=MODEL, prompt="keep going", max_tokens=48, stream=True,
                                           extra_body={"ignore_eos": True})
        good["chunks"] = list(stream)

    t = threading.Thread(target=run_good)
    t.start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, path, body, status in BAD_REQUESTS:
            if body is None:
                r = http.post(path) if path != "/v1/models" else http.delete(path)
            elif isinstance(body, (bytes, tuple)):
                content, ctype = body if isinstance(body, tuple) else (body, "application/json")
                r = http.post(path, content=content, headers={"content-type": ctype})
            else:
                r = http.post(path, json=body)
            assert r.status_code == status, f"{name}: {r.status_code} {r.text}"
            err = r.json()["error"]  # every error, 404 and 405 included, in OpenAI's format
            assert err["type"] == "invalid_request_error" and err["message"], name
        assert http.get("/health").status_code == 200
    t.join(60)
    assert good["chunks"][-1].choices[0].finish_reason == "length"
    assert sum(1 for c in good["chunks"] if c.choices[0].text) >= 1


def test_openai_bookkeeping_fields_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       store=False, metadata={"team": "a"}, service_tier="auto",
                                       parallel_tool_calls=True, user="u-1")
    assert r.choices[0].finish_reason in ("length", "stop")
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="u-1")
    assert r.usage.completion_tokens <= 2


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_queue_full_is_429_with_retry_after(server):
    cfg = server.engine.config
    saved = cfg.max_waiting
    cfg.max_waiting = 0  # every new request finds the queue full
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    finally:
        cfg.max_waiting = saved
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"


def test_client_disconnect_frees_kv(server):
    engine = server.engine
    wait_idle(engine)
    for stream in (True, False):
        body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 1000, "ignore_eos": True,
                "stream": stream}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            if stream:
                with http.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    assert next(lines).startswith("data: ")
                    assert engine.kv_usage > 0
            else:
                with pytest.raises(httpx.ReadTimeout):
                    http.post("/v1/completions", json=body, timeout=0.5)
        wait_idle(engine)  # the request was aborted and its blocks returned
    assert engine.stats.num_aborted >= 2


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("sparkspec_requests_total", "sparkspec_prompt_tokens_total", "sparkspec_generation_tokens_total",
                 "sparkspec_num_requests_waiting", "sparkspec_time_to_first_token_seconds_bucket",
                 "sparkspec_time_per_output_token_seconds_bucket", "sparkspec_kv_cache_usage_ratio",
                 "sparkspec_spec_decode_num_draft_tokens_total", "sparkspec_spec_decode_num_accepted_tokens_total",
                 "sparkspec_http_errors_total", "sparkspec_decode_rows_total"):
        assert name in text, name
    assert server.engine.stats.num_drafted > 0 or server.engine.stats.num_drafter_skipped_steps > 0


GATED_SERVER = """
import sys, threading, time
import sparkspec.engine.llm_engine as llm_engine
import sparkspec.serve.api as api

# The engine decides the outcome, not the clock: before SIGTERM the batch is held once every open request has a
# token (both streams are provably running when the signal comes); during the drain it steps only while two
# requests are open, so the short one finishes and the long one is then held until the timeout cuts it.
draining, real_step, real_create_app = threading.Event(), llm_engine.LLMEngine.step, api.create_app

def step(self):
    seqs = list(self.requests.values())
    hold = len(seqs) < 2 if draining.is_set() else all(s.output_ids for s in seqs)
    if hold:
        time.sleep(0.01)
        return []
    return real_step(self)

def create_app(*args, **kwargs):
    app = real_create_app(*args, **kwargs)
    drain = app.state.drain

    async def gated_drain(timeout):
        draining.set()
        await drain(timeout)

    app.state.drain = gated_drain
    return app

llm_engine.LLMEngine.step, api.create_app = step, create_app
from sparkspec.serve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_drains_then_cuts_what_is_left(tiny_checkpoint_with_drafters):
    """SIGTERM: new requests get 503, a running stream that finishes within --shutdown-timeout ends normally, one
    that does not ends with an error event and [DONE]; the log says how many of each; the exit code is 0. Which
    stream finishes is fixed by the engine (GATED_SERVER), whatever the machine's speed: the timeout is only the
    cut, and a safety net for the short stream's 11 remaining tiny steps."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", GATED_SERVER, "--model", str(tiny_checkpoint_with_drafters),
                             "--port", str(port), "--spec", "none", "--log-level", "warning",
                             "--served-model-name", "tiny", "--shutdown-timeout", "10"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    streams: dict = {}
    started = {name: threading.Event() for name in ("short", "long")}

    def stream(name: str, max_tokens: int):  # token_sources: a chunk per token, even one without text
        body = {"model": "tiny", "prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "sparkspec": {"token_sources": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started[name].set()
            streams[name] = lines

    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.1)
        threads = [threading.Thread(target=stream, args=a) for a in (("short", 12), ("long", 2000))]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started.values())
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while httpx.get(url + "/health", timeout=30).status_code == 200:  # until the signal is handled
            assert time.time() < deadline, "SIGTERM was not handled"
            time.sleep(0.05)
        late = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and late.json()["error"]["type"] == "server_error", late.text
        for t in threads:
            t.join(60)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read().decode()
    short, long = streams["short"], streams["long"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length", short[-3:]
    assert long[-1] == "[DONE]" and "shutting down" in json.loads(long[-2])["error"]["message"], long[-3:]
    assert "1 request(s) finished, 1 cut" in out and "shut down cleanly" in out, out


def test_bench_serve_against_the_server(server, tmp_path):
    from sparkspec.cli import main

    out, png = tmp_path / "s.json", tmp_path / "s.png"
    args = ["bench", "serve", "--base-url", server.url, "--label", "dspark adaptive", "--concurrency", "1,4",
            "--output-len", "4", "--min-requests", "2", "--requests-per-client", "1", "--json", str(out)]
    assert main(args) == 0
    assert main(args[:-1] + [str(out), "--append", "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in rows] == [1, 4, 1, 4]
    assert all(r["output_tokens"] == 4 * r["num_requests"] and r["ttft_ms_p50"] > 0 for r in rows)
    assert png.stat().st_size > 1000
