"""The playground in a real browser: headless Chromium driven by Playwright against the shipped demo model
(served in-process), through the page's own controls. Skipped, saying why, when Playwright or a Chromium
binary is missing (`.ci/run` installs the distribution's Chromium; Playwright's own browser download is not
used). Every wait is bounded, so a broken page fails in seconds instead of hanging CI."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
from test_server import Server

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.loading.checkpoint import load_checkpoint

DEMO = Path(__file__).resolve().parents[1] / "checkpoints" / "demo"
WAIT_MS = 20_000  # the longest any one step of the page may take (a 24-token answer takes about 1 s on 2 cores)
K = 4


def chromium() -> str | None:
    """The browser binary: $SPARKSPEC_CHROMIUM, else the distribution's (Debian: chromium)."""
    found = os.environ.get("SPARKSPEC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return found if found and os.access(found, os.X_OK) else None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install "
                                   "playwright, part of the 'test' extra): the playground browser test is skipped")
    path = chromium()
    if path is None:
        pytest.skip("no Chromium binary found (apt-get install chromium, or set SPARKSPEC_CHROMIUM): the "
                    "playground browser test is skipped")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"], timeout=WAIT_MS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def demo_server():
    ckpt = load_checkpoint(DEMO)
    config = EngineConfig(max_num_seqs=4, speculative="dspark", num_spec_tokens=K, spec_budget="fixed")
    with Server(LLMEngine(ckpt.model, ckpt.tokenizer, config, ckpt.drafter_tensors)) as s:
        yield s


@pytest.fixture()
def page(browser, demo_server):
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    pg = context.new_page()
    pg.set_default_timeout(WAIT_MS)
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(demo_server.url + "/")
    pg.wait_for_selector("body[data-ready='1']")
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def send(pg, prompt: str, runs: int) -> None:
    pg.fill("#prompt", prompt)
    pg.press("#prompt", "Enter")
    pg.wait_for_selector(f"body[data-runs='{runs}']")


def test_controls_show_what_the_server_allows(page):
    assert page.is_disabled("#method") and page.input_value("#method") == "dspark"
    assert "--spec" in page.inner_text("#method-note")
    assert page.is_enabled("#k") and page.get_attribute("#k", "max") == str(K)
    assert page.locator("#legend-items li").count() == 2 + K


def test_chat_streams_coloured_tokens_with_live_figures(page):
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    send(page, "Write a haiku about the sea.", 1)
    tokens = page.locator(".msg.assistant .tok")
    assert tokens.count() == 24 == int(page.inner_text("#ntokens"))
    assert page.locator(".msg.assistant .tok.src-draft").count() > 0  # the demo's drafter is right often
    colours = {tokens.nth(i).evaluate("e => getComputedStyle(e).backgroundColor") for i in range(tokens.count())}
    assert len(colours) >= 2 and "rgba(0, 0, 0, 0)" not in colours
    assert float(page.inner_text("#tau")) > 1 and float(page.inner_text("#tps")) > 0
    assert page.locator("#chart rect").count() == 2 * K
    assert page.is_hidden("#error")
    send(page, "And about the moon?", 2)  # the second turn sends the first exchange as history
    assert page.locator(".msg").count() == 4 and page.is_hidden("#error")


def test_completion_mode(page):
    page.check("input[value=completion]")
    page.fill("#max_tokens", "8")
    send(page, "The sea is", 1)
    assert page.inner_text(".msg.completion .prompt-text") == "The sea is"
    assert page.locator(".msg.completion .tok").count() == 8


def test_bad_setting_shows_the_servers_error(page, demo_server):
    page.fill("#temperature", "-1")
    send(page, "Hello", 1)
    expected = httpx.post(demo_server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "temperature": -1}).json()["error"]
    assert page.is_visible("#error")
    assert expected["message"] in page.inner_text("#error") and "temperature" in expected["message"]
    assert page.locator(".msg").count() == 0  # nothing was added to the conversation
