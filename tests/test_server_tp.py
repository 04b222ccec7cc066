"""`sparkspec serve --tensor-parallel-size 2` over gloo on CPU: the real `openai` client gets the same greedy
text as from a single-process server; SIGTERM stops rank 0 and the rank it launched."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sparkspec.cli", "serve", "--model", str(model), "--port", str(port),
                             "--device", "cpu", "--spec", "dspark", "--spec-budget", "fixed", "--max-num-seqs", "4",
                             "--log-level", "warning", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail("server did not start")


def answers(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    out = [client.completions.create(model=name, prompt=p, max_tokens=12, temperature=0).choices[0].text
           for p in ("hello there", "a b c d")]
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0)
    return out + [chat.choices[0].message.content]


def test_two_process_server_answers_like_one(tiny_checkpoint_with_drafters):
    one, one_url = start(tiny_checkpoint_with_drafters)
    two, two_url = start(tiny_checkpoint_with_drafters, "--tensor-parallel-size", "2", "--enable-expert-parallel")
    try:
        wait_ready(one, one_url)
        wait_ready(two, two_url)
        want = answers(one_url)
        assert answers(two_url) == want and any(want)
    finally:
        for proc in (one, two):
            proc.send_signal(signal.SIGTERM)
        for proc in (one, two):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    log = two.stdout.read()
    assert two.returncode == 0, log
    assert "shut down cleanly" in log
