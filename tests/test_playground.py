"""The playground's server side: the page and its static files, /v1/sparkspec/info, and the opt-in `sparkspec`
extension (per-token provenance), which standard OpenAI clients never see."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from test_server import MODEL, Server

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.engine.sequence import TokenSource
from sparkspec.loading.checkpoint import load_checkpoint
from sparkspec.sampling_params import SamplingParams
from sparkspec.serve.api import STATIC_DIR
from sparkspec.spec_decode.proposer import HostProposer

PROMPT = [5, 6, 7, 8, 9] * 8
K = 3


class GreedyReplay(HostProposer):
    """Drafts the target's own greedy continuation of PROMPT, so at temperature 0 every draft is accepted (a
    random tiny model never repeats itself, so n-gram lookup would draft nothing); other prompts get none."""

    method = "replay"

    def __init__(self, reference: list[int]):
        super().__init__(K)
        self.reference = reference

    def propose_ids(self, token_ids, k):
        known = [ids[: len(PROMPT)] == PROMPT for ids in token_ids]
        return [self.reference[len(ids) - len(PROMPT):][:k] if ok else [] for ids, ok in zip(token_ids, known)]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def replay(ckpt, tmp_path_factory):
    plain = LLMEngine(ckpt.model, ckpt.tokenizer, EngineConfig())
    greedy = plain.generate([PROMPT], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0].token_ids
    config = EngineConfig(spec_budget="fixed", cost_cache_dir=str(tmp_path_factory.mktemp("costs")))
    with Server(LLMEngine(ckpt.model, ckpt.tokenizer, config, proposer=GreedyReplay(greedy))) as s:
        yield s


@pytest.fixture(scope="module")
def plain(ckpt):
    with Server(LLMEngine(ckpt.model, ckpt.tokenizer, EngineConfig())) as s:
        yield s


def sse(response: httpx.Response) -> list[dict]:
    events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def body(**extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}


def test_token_source_of_step():
    assert TokenSource.of_step(0, 0) == [TokenSource.TARGET]
    assert TokenSource.of_step(3, 0) == [TokenSource.TARGET]  # rejected at once: the target's correction
    assert TokenSource.of_step(3, 2) == [1, 2, TokenSource.TARGET]
    assert TokenSource.of_step(3, 3) == [1, 2, 3, TokenSource.BONUS]


def test_streamed_sources_add_up_to_the_engines_counts(replay):
    engine = replay.engine
    before = engine.stats.num_accepted
    request = body(stream=True, stream_options={"include_usage": True}, sparkspec={"token_sources": True})
    with httpx.stream("POST", replay.url + "/v1/completions", json=request, timeout=60) as r:
        assert r.status_code == 200
        chunks = sse(r)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert all("sparkspec" in c for c in choices)
    sources = [s for c in choices for s in c["sparkspec"]["token_sources"]]
    texts = [t for c in choices for t in c["sparkspec"]["token_texts"]]
    spec = choices[-1]["sparkspec"]["spec"]
    assert len(sources) == len(texts) == chunks[-1]["usage"]["completion_tokens"] == 24
    assert "".join(texts) == "".join(c["text"] for c in choices)
    accepted = sum(1 for s in sources if s > 0)
    assert accepted == spec["accepted"] == engine.stats.num_accepted - before > 0
    # every draft is right: the first token, then steps of K drafts + the bonus; the last step verifies only
    # what max_tokens leaves room for
    assert sources == [0] + [1, 2, 3, TokenSource.BONUS] * 5 + [1, 2, TokenSource.BONUS]
    assert sources.count(TokenSource.BONUS) <= spec["steps"]
    for j in range(1, K + 1):  # accepted drafts at position j: one per step that got that far
        assert sources.count(j) == spec["accepted_per_position"][j - 1]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_non_streamed_choices_carry_all_their_sources(replay, endpoint):
    prompt = {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{replay.url}/v1/{endpoint}", timeout=60, json={
        "model": MODEL, **prompt, "max_tokens": 12, "n": 2, "temperature": 0, "ignore_eos": True,
        "sparkspec": {"token_sources": True}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        ext = choice["sparkspec"]
        text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
        assert len(ext["token_sources"]) == len(ext["token_texts"]) == 12
        assert "".join(ext["token_texts"]) == text
        accepted = sum(1 for s in ext["token_sources"] if s > 0)
        assert accepted == ext["spec"]["accepted"] and (accepted > 0) == (endpoint == "completions")


def test_per_request_k_bounds_the_draft_positions(replay):
    r = httpx.post(replay.url + "/v1/completions", timeout=60,
                   json=body(speculative={"num_spec_tokens": 1}, sparkspec={"token_sources": True}))
    sources = r.json()["choices"][0]["sparkspec"]["token_sources"]
    assert max(sources) <= 1 and 1 in sources


def test_standard_clients_see_standard_objects(replay):
    client = openai.OpenAI(base_url=replay.url + "/v1", api_key="none", max_retries=0, timeout=60)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True, temperature=0))
    assert chunks and all("sparkspec" not in c.choices[0].model_dump() for c in chunks)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "sparkspec" not in chat.choices[0].model_dump() and not chat.choices[0].model_extra
    off = httpx.post(replay.url + "/v1/completions", json=body(sparkspec={"token_sources": False}), timeout=60)
    assert "sparkspec" not in off.json()["choices"][0]


@pytest.mark.parametrize("value,param", [(1, "sparkspec"), ({"token_sources": "yes"}, "sparkspec.token_sources"),
                                         ({"colours": True}, "sparkspec"), ([], "sparkspec")])
def test_bad_extension_is_400_naming_the_field(replay, value, param):
    r = httpx.post(replay.url + "/v1/completions", json=body(sparkspec=value), timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_info_reports_what_a_request_may_set(replay, plain):
    info = httpx.get(replay.url + "/v1/sparkspec/info").json()
    assert info["model"] == MODEL and info["default_max_tokens"] == 8
    spec = info["speculative"]
    assert spec["method"] == "replay" and spec["num_spec_tokens"] == K and spec["per_request_num_spec_tokens"]
    assert spec["per_request_method"] is False and "--spec" in spec["per_request_method_reason"]
    off = httpx.get(plain.url + "/v1/sparkspec/info").json()["speculative"]
    assert off["method"] == "none" and off["num_spec_tokens"] == 0 and not off["per_request_num_spec_tokens"]


def test_page_and_static_files_are_served_and_self_contained(plain):
    page = httpx.get(plain.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/static/app.js" in page.text and "/static/style.css" in page.text
    for name in ("app.js", "style.css"):
        r = httpx.get(f"{plain.url}/static/{name}")
        assert r.status_code == 200 and r.text == (STATIC_DIR / name).read_text()
    for path in STATIC_DIR.iterdir():  # offline: nothing fetched from another host
        assert not re.search(r"(src|href)=\"(https?:)?//", path.read_text()), path.name
        assert "https://" not in path.read_text().replace("http://www.w3.org/2000/svg", ""), path.name
    missing = httpx.get(plain.url + "/static/nope.js")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_page_reads_the_metric_names_the_server_exports(replay):
    """app.js parses /metrics by name: the names must exist in the exposition."""
    httpx.post(replay.url + "/v1/completions", json=body(), timeout=60)
    metrics = httpx.get(replay.url + "/metrics").text
    app = (STATIC_DIR / "app.js").read_text()
    for name in ("sparkspec_spec_decode_num_drafts_total", "sparkspec_spec_decode_num_accepted_tokens_per_pos_total"):
        assert name in app and re.search(rf"^{name}[ {{]", metrics, re.MULTILINE), name
