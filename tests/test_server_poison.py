"""Poison requests against a `--spec dspark` server (issue 18): requests valid by the schema that used to fail
their batch-mates and, eight in a row, stop the server.

Two kinds: tiny temperatures (1e-45 .. 1e-6, with top_p / top_k at their edges), now served greedily (200, the
greedy tokens exactly); and requests whose distribution is not finite, made real by setting the embedding row of
one token id X to NaN (a prompt that ends in X): 500 for that request only, naming the cause. Neither kind
touches anything else: 16 of each in a row leave the server healthy (more than the engine's limit of failed
steps in a row), the next request is exact, and good streams that run while poison requests arrive are exact
token for token (`sparkspec.token_texts`) and in text. References come from an offline engine of the same
configuration on the clean model; no outcome depends on timing.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from test_server import MODEL, Server, load_checkpoint, wait_idle

from sparkspec.engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.engine.step_result import NONFINITE_ERROR
from sparkspec.sampling_params import SamplingParams
from sparkspec.serve.provenance import Provenance

MAX_TOKENS = 10
TINY = [(t, f) for t in (1e-45, 1e-40, 1e-38, 1e-30, 1e-6)
        for f in ({}, {"top_p": 5e-324}, {"top_k": 1}, {"top_k": 2**63 - 1, "top_p": 1e-300})]
GOOD = [{"temperature": 0}, {"temperature": 0.8, "seed": 5}, {"temperature": 1.0, "top_p": 0.9, "seed": 6},
        {"temperature": 0.7, "top_k": 4, "seed": 7}]


def config() -> EngineConfig:
    return EngineConfig(max_num_seqs=16, max_waiting=256, speculative="dspark", spec_budget="fixed")


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 200, (3 + i % 7,), generator=g).tolist() for i in range(n)]


def params_of(body: dict) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=body.get("temperature", 1.0),
                          top_p=body.get("top_p", 1.0), top_k=body.get("top_k", 0), seed=body.get("seed"))


@pytest.fixture(scope="module")
def setup(tiny_checkpoint_with_drafters):
    """-> (server, good prompts, their (text, token_texts), tiny-T prompts, theirs, the poison token X)."""
    ckpt = load_checkpoint(tiny_checkpoint_with_drafters)
    model, tok = ckpt.model, ckpt.tokenizer
    good, tiny = prompts(8, 1), prompts(len(TINY), 2)
    offline = LLMEngine(model, tok, config(), ckpt.drafter_tensors)
    good_outs = offline.generate(good, [params_of(GOOD[i % len(GOOD)]) for i in range(len(good))])
    tiny_outs = offline.generate(tiny, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))  # greedy
    seen = {t for o in good_outs + tiny_outs for t in o.prompt_token_ids + o.token_ids}
    X = next(t for t in range(4, model.cfg.vocab_size) if t not in seen)
    with torch.no_grad():  # a private copy of the row's tensor, then NaN: the model is broken after X only
        model.embed.weight.data = model.embed.weight.data.clone()
        model.embed.weight[X] = float("nan")

    def expected(outs):
        return [(o.text, Provenance(tok).texts(o.token_ids, True)) for o in outs]

    engine = LLMEngine(model, tok, config(), ckpt.drafter_tensors)
    with Server(engine) as s:
        yield s, good, expected(good_outs), tiny, expected(tiny_outs), X


def body(prompt: list[int], stream: bool = False, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream,
            "sparkspec": {"token_sources": True}, **kw}


def result(r: httpx.Response) -> tuple[str, list[str]]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["text"], choice["sparkspec"]["token_texts"]


def assert_nonfinite_500(r: httpx.Response) -> None:
    assert r.status_code == 500 and r.json()["error"]["message"] == NONFINITE_ERROR, r.text


def test_sixteen_poison_requests_in_a_row_leave_the_server_healthy(setup):
    server, good, good_ref, tiny, tiny_ref, X = setup
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for i in range(16):  # served greedily, exactly
            t, f = TINY[i]
            assert result(http.post("/v1/completions", json=body(tiny[i], temperature=t, **f))) == tiny_ref[i], TINY[i]
        assert 16 > MAX_CONSECUTIVE_STEP_FAILURES
        for i in range(16):  # each alone in its steps: every one fails, none counts against the engine
            assert_nonfinite_500(http.post("/v1/completions", json=body(good[i % 8][:3] + [X], temperature=0)))
        assert http.get("/health").status_code == 200
        assert result(http.post("/v1/completions", json=body(good[1], **GOOD[1]))) == good_ref[1]
    wait_idle(server.engine)


async def stream(http: httpx.AsyncClient, payload: dict) -> tuple[str, list[str]] | str:
    """A streamed completion -> (text, token_texts), or the error message its stream ended with."""
    text, pieces, finish = "", [], None
    async with http.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return chunk["error"]["message"]
            choice = chunk["choices"][0]
            text += choice["text"]
            pieces += choice["sparkspec"]["token_texts"]
            finish = choice["finish_reason"] or finish
    assert finish == "length"
    return text, pieces


def test_concurrent_poison_requests_leave_good_streams_exact(setup):
    server, good, good_ref, tiny, tiny_ref, X = setup
    failed_before = server.engine.stats.num_failed

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as http:
            goods = [stream(http, body(p, True, **GOOD[i % len(GOOD)])) for _ in range(2) for i, p in enumerate(good)]
            nan_streams = [stream(http, body(tiny[i][:2] + [X], True, temperature=0.9, seed=i)) for i in range(6)]
            nan_plain = [http.post("/v1/completions", json=body(good[i][:4] + [X], temperature=1e-40))
                         for i in range(6)]
            tinies = [stream(http, body(tiny[i], True, temperature=t, **f)) for i, (t, f) in enumerate(TINY)]
            jobs = [j for group in zip(goods, nan_streams + nan_plain + tinies[:4]) for j in group] + tinies[4:]
            results = await asyncio.gather(*jobs)
            health = (await http.get("/health")).status_code
            return results, health

    results, health = asyncio.run(main())
    goods, others = results[0:32:2], results[1:32:2] + results[32:]
    assert goods == good_ref * 2
    nan_streams, nan_plain, tinies = others[:6], others[6:12], others[12:]
    assert nan_streams == [NONFINITE_ERROR] * 6
    for r in nan_plain:
        assert_nonfinite_500(r)
    assert tinies == tiny_ref and health == 200
    assert server.engine.stats.num_failed == failed_before + 12
    wait_idle(server.engine)
