"""One request must never take the server down: a failing engine step fails only its own requests, a large
body is refused (413) or processed off the event loop, and an engine thread that dies makes the process exit
non-zero (for a supervisor to restart it) instead of living on answering 503."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import Server, free_port, wait_idle

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.loading.checkpoint import load_checkpoint

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    """One sequence at a time: a second request waits, so it is never in the step that fails."""
    ckpt = load_checkpoint(tiny_checkpoint)
    engine = LLMEngine(ckpt.model, ckpt.tokenizer, EngineConfig(max_num_seqs=1, speculative="none"))
    with Server(engine) as s:
        yield s


class HealthWatch:
    """Polls /health from a thread; `worst` is the slowest answer (seconds), `bad` the non-200 answers."""

    def __init__(self, url: str):
        self.url, self.worst, self.bad, self.n = url, 0.0, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                t = time.perf_counter()
                status = http.get(self.url + "/health").status_code
                self.worst, self.n = max(self.worst, time.perf_counter() - t), self.n + 1
                if status != 200:
                    self.bad.append(status)
                time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(15)


def sse_events(response: httpx.Response) -> list:
    """The data lines of an SSE response, decoded ('[DONE]' kept as the string)."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in response.iter_lines()
            if line.startswith("data: ")]


def test_a_failing_step_fails_only_its_request(server, monkeypatch):
    engine, async_engine = server.engine, server.app.state.engine
    real_step, armed = engine.step, threading.Event()

    def step():  # when armed, fails after the real step has scheduled (and run) its batch
        outputs = real_step()
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected step failure")
        return outputs

    monkeypatch.setattr(engine, "step", step)
    waiting: dict = {}

    def run_waiting():  # queued behind the failing request: must complete intact
        body = {"model": MODEL, "prompt": "second", "max_tokens": 6, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            waiting["events"] = sse_events(r)

    with HealthWatch(server.url) as health, httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": "first", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # running
            t = threading.Thread(target=run_waiting)
            t.start()
            deadline = time.time() + 30
            while async_engine.stats()["num_waiting"] < 1:
                assert time.time() < deadline, "the second request was not queued"
                time.sleep(0.01)
            armed.set()
            rest = [json.loads(x[6:]) if x != "data: [DONE]" else x[6:] for x in lines if x.startswith("data: ")]
        assert rest[-1] == "[DONE]" and rest[-2]["error"]["type"] == "server_error", rest[-3:]
        t.join(60)
        events = waiting["events"]
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert events[-3]["choices"][0]["finish_reason"] == "length" and events[-2]["usage"]["completion_tokens"] == 6

        wait_idle(engine)
        armed.set()  # a non-streaming request in a failing step: a 500 in OpenAI's format
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    assert health.n > 0 and not health.bad
    wait_idle(engine)  # the failed requests were aborted: their blocks are back
    assert async_engine.is_running


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "seed": 2**64}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "seed": -(2**63) - 1}),
])
def test_seed_out_of_range_is_400_and_the_server_carries_on(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    ok = httpx.post(server.url + path, json={**body, "seed": 2**64 - 1}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_large_bodies(server):
    big = json.dumps({"model": MODEL, "prompt": "x" * (9 << 20)}).encode()
    t = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert time.perf_counter() - t < 5

    def chunked():  # no Content-Length: the size is counted as the body arrives
        for _ in range(9):
            yield b" " * (1 << 20)

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413, r.text


def test_long_prompts_count_the_same_tokens(server):
    """Texts over 64K characters are encoded through another tokenizer call (one that releases the GIL)."""
    prompt = "Hello, wörld! " * 6000
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                   timeout=60)
    n = len(server.engine.tokenizer.encode(prompt, add_special_tokens=True))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{n} prompt tokens"), r.text


def test_health_answers_while_a_large_prompt_is_tokenised(server):
    body = json.dumps({"model": MODEL, "prompt": "hello world " * ((4 << 20) // 12), "max_tokens": 2}).encode()
    with HealthWatch(server.url) as health:
        time.sleep(0.2)
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=120)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
    assert not health.bad and health.n >= 3 and health.worst < 1.0, (health.worst, health.n)


BROKEN_SERVER = """
import sys
import sparkspec.engine.async_engine as a

def broken(self, cmd):  # a bug outside engine.step(): the engine loop itself dies
    raise RuntimeError("injected engine-loop bug")

a.AsyncLLMEngine._handle = broken
from sparkspec.serve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_engine_loop_death_exits_nonzero(tiny_checkpoint):
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", BROKEN_SERVER, "--model", str(tiny_checkpoint), "--port", str(port),
                             "--spec", "none", "--log-level", "warning", "--served-model-name", MODEL],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.1)
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
            assert r.status_code == 503, r.text
        except httpx.HTTPError:  # the server may already be closing the connection
            pass
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read().decode()
    assert "injected engine-loop bug" in out and "exiting with code 1" in out, out
