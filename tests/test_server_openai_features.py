"""OpenAI features through the live server and the real `openai` client, on the fp32 tiny checkpoint: n samples,
logprobs (equal under DSpark, MTP and n-gram to plain decoding's), echo with prompt logprobs and max_tokens 0,
stream_options.include_usage, and the per-request `speculative` extension. Logprobs of accepted drafts are
checked at the engine level too (tests/test_engine_logprobs.py), where acceptance can be forced."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_server import MODEL, Server, wait_idle

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.loading.checkpoint import load_checkpoint

PROMPT = [0, 17, 99, 250, 7, 17, 99]
NGRAM_PROMPT, NGRAM_TOKENS = "Hello world", 40  # the tiny model's greedy output repeats itself here


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint_with_drafters):
    return load_checkpoint(tiny_checkpoint_with_drafters)


def start(ckpt, method: str, tmp_path_factory) -> Server:
    config = EngineConfig(max_num_seqs=16, speculative=method, spec_budget="fixed",
                          cost_cache_dir=str(tmp_path_factory.mktemp("costs")))
    return Server(LLMEngine(ckpt.model, ckpt.tokenizer, config, ckpt.drafter_tensors))


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    """One server per method, all on the same weights."""
    running = {m: start(ckpt, m, tmp_path_factory).__enter__() for m in ("none", "dspark", "mtp", "ngram")}
    yield running
    for s in running.values():
        s.__exit__(None, None, None)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def completion_logprobs(server, max_tokens: int, prompt=PROMPT):
    r = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          logprobs=3, extra_body={"ignore_eos": True})
    return r.choices[0].logprobs


@pytest.mark.parametrize("method", ["dspark", "mtp", "ngram"])
def test_speculative_logprobs_equal_plain(servers, method):
    n, prompt = (NGRAM_TOKENS, NGRAM_PROMPT) if method == "ngram" else (12, PROMPT)
    stats = servers[method].engine.stats
    before = stats.num_drafted, stats.num_accepted
    plain, spec = completion_logprobs(servers["none"], n, prompt), completion_logprobs(servers[method], n, prompt)
    assert stats.num_drafted > before[0]  # random drafters rarely match at T = 0: test_engine_logprobs forces it
    if method == "ngram":
        assert stats.num_accepted > before[1], "no draft was accepted: the test shows nothing"
    assert spec.tokens == plain.tokens and len(spec.token_logprobs) == n
    assert max(abs(a - b) for a, b in zip(spec.token_logprobs, plain.token_logprobs)) < 1e-4
    for a, b in zip(spec.top_logprobs, plain.top_logprobs):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)  # (keys: texts, may collide)


def test_chat_logprobs_under_speculation(servers):
    def ask(server):
        r = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=8, temperature=0, logprobs=True, top_logprobs=4,
                                                   extra_body={"ignore_eos": True})
        return r.choices[0].logprobs.content

    plain, spec = ask(servers["none"]), ask(servers["dspark"])
    assert [t.token for t in spec] == [t.token for t in plain] and len(spec) == 8
    for a, b in zip(spec, plain):
        assert abs(a.logprob - b.logprob) < 1e-4 and len(a.top_logprobs) == 4
        assert a.bytes == list(a.token.encode())
        assert a.logprob <= a.top_logprobs[0].logprob + 1e-6  # top_logprobs[0] is the argmax
        values = [t.logprob for t in a.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_streamed_logprobs_match_the_body(servers):
    c = client(servers["dspark"])
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    body = c.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw)]
    assert "".join(ch.text for ch in chunks) == body.text
    assert sum((ch.logprobs.token_logprobs for ch in chunks if ch.logprobs), []) == body.logprobs.token_logprobs
    assert chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("method", ["none", "dspark"])
def test_n_samples_seeded(servers, method):
    c = client(servers[method])
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1.0, n=3, seed=1234,
              extra_body={"ignore_eos": True})
    first, second = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert [ch.text for ch in first.choices] == [ch.text for ch in second.choices]
    assert len({ch.text for ch in first.choices}) > 1
    assert first.usage.completion_tokens == 24
    one = c.completions.create(**{**kw, "n": 1})
    assert one.choices[0].text == first.choices[0].text  # sample 0 keeps the request's own seed


def test_n_samples_streamed_interleave(servers):
    c = client(servers["dspark"])
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=1.0, n=3,
              seed=7, extra_body={"ignore_eos": True})
    body = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, finish = ["", "", ""], [None] * 3
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        texts[choice.index] += choice.delta.content or ""
        finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [ch.message.content for ch in body.choices] and finish == ["length"] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18


def test_n_out_of_range_is_400(servers):
    with httpx.Client(base_url=servers["none"].url) as http:
        for n in (0, 17, "2", 1.5):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": n})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", (n, r.text)


def test_echo_with_prompt_logprobs_and_max_tokens_zero(servers):
    c = client(servers["dspark"])
    r = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True, logprobs=2)
    ch = r.choices[0]
    assert ch.text == "Hello there" and ch.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = ch.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == r.usage.prompt_tokens and all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) <= 3 for t in lp.top_logprobs[1:])  # the 2 best, plus the prompt token if not among them
    r = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, echo=True, logprobs=1, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith("Hello there") and len(r.choices[0].logprobs.tokens) == \
        r.usage.prompt_tokens + 3
    r = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True)
    assert r.choices[0].text == "Hello there" and r.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", max_tokens=0)


def test_echo_streamed_starts_with_the_prompt(servers):
    chunks = list(client(servers["dspark"]).completions.create(
        model=MODEL, prompt="Hello there", max_tokens=4, echo=True, logprobs=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith("Hello there")
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert chunks[-1].choices[0].finish_reason == "length"


def test_include_usage_and_finish_reasons(servers):
    c = client(servers["dspark"])
    chunks = list(c.completions.create(model=MODEL, prompt="Hi", max_tokens=5, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
    assert all(ch.usage is None for ch in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"
    full = c.completions.create(model=MODEL, prompt="Hi", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    stop = full.choices[0].text[3:5]
    cut = c.completions.create(model=MODEL, prompt="Hi", max_tokens=12, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text


def test_speculative_extension(servers):
    server = servers["dspark"]
    wait_idle(server.engine)
    stats = server.engine.stats
    c = client(server)
    drafted, spec_steps = stats.num_drafted, stats.num_spec_steps
    off = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                               extra_body={"ignore_eos": True, "speculative": {"num_spec_tokens": 0}})
    assert stats.num_drafted == drafted  # k = 0: no draft verified
    disabled = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True, "speculative": {"enabled": False}})
    assert stats.num_drafted == drafted
    accepted_at = list(stats.accepted_per_position)
    capped = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True, "speculative": {"num_spec_tokens": 1}})
    # capped at 1: it drafted, and every step that verified drafts verified exactly one, accepted at position 0 only
    assert stats.num_drafted - drafted == stats.num_spec_steps - spec_steps > 0
    assert list(stats.accepted_per_position)[1:] == accepted_at[1:]
    assert off.choices[0].text == disabled.choices[0].text == capped.choices[0].text
    k = server.engine.spec.num_spec_tokens
    with httpx.Client(base_url=server.url) as http:
        for spec in ({"num_spec_tokens": k + 1}, {"num_spec_tokens": -1}, {"num_spec_tokens": "2"},
                     {"num_spec_tokens": True}, {"enabled": False, "num_spec_tokens": 2}):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "speculative": spec})
            assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.num_spec_tokens", r.text
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "speculative": {"k": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
    with httpx.Client(base_url=servers["none"].url) as http:
        for spec in ({"num_spec_tokens": 1}, {"enabled": True}):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "speculative": spec})
            assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.num_spec_tokens", r.text
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                               "speculative": {"enabled": False}})
        assert r.status_code == 200, r.text


def test_logprob_fields_out_of_range_are_400(servers):
    with httpx.Client(base_url=servers["none"].url) as http:
        for path, body, param in (
            ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
            ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                      "top_logprobs": 21}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
             "top_logprobs"),
        ):
            r = http.post(path, json={"model": MODEL, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
