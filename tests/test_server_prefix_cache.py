"""A multi-turn chat through the server with the `openai` client: each turn resends the conversation, the cache
serves its prefix, and every reply equals the one a server without the cache gives (DSpark, greedy)."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from test_server import MODEL, Server

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.loading.checkpoint import load_checkpoint

SYSTEM = " ".join(f"Rule {i}: answer in plain words, cite item {i * 7 % 13} and keep it short." for i in range(12))
QUESTIONS = ["What is the first rule?", "And the second one?", "Summarise both."]


def chat(server: Server, turns: list[str], cached: list[int] | None = None) -> list[str]:
    """The replies; `cached` receives each turn's usage.prompt_tokens_details.cached_tokens."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages, replies = [{"role": "system", "content": SYSTEM}], []
    for q in turns:
        messages.append({"role": "user", "content": q})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        reply = r.choices[0].message.content or ""
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
        if cached is not None:
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
    return replies


def counter(metrics: str, name: str) -> float:
    m = re.search(rf"^{name}_total (\S+)$", metrics, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("spec", ["dspark"])
def test_multi_turn_chat_hits_the_cache_and_answers_the_same(tiny_checkpoint_with_drafters, tmp_path, spec):
    ckpt = load_checkpoint(tiny_checkpoint_with_drafters)
    answers, hits, cached = {}, {}, {}
    for caching in (False, True):
        config = EngineConfig(max_num_seqs=8, speculative=spec, spec_budget="fixed", num_spec_tokens=3,
                              enable_prefix_caching=caching)
        engine = LLMEngine(ckpt.model, ckpt.tokenizer, config, ckpt.drafter_tensors)
        with Server(engine) as s:
            cached[caching] = []
            answers[caching] = chat(s, QUESTIONS, cached[caching])
            metrics = httpx.get(s.url + "/metrics").text
            hits[caching] = (counter(metrics, "sparkspec_prefix_cache_queries"),
                             counter(metrics, "sparkspec_prefix_cache_hits"))
    assert answers[True] == answers[False]
    queries, hit = hits[True]
    assert hits[False] == (0.0, 0.0)  # off: nothing is looked up
    assert cached[False] == [0, 0, 0] and cached[True][0] == 0 and all(c > 0 for c in cached[True][1:])
    assert sum(cached[True]) == hit  # usage reports the hits the metrics count
    assert hit > 0.5 * queries * (len(QUESTIONS) - 1) / len(QUESTIONS)  # turns 2.. share most of their prompt
