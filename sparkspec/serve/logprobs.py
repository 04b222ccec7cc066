"""Logprobs in OpenAI's two response shapes, from the engine's per-token {id: logprob} dicts (the N most likely
first, then the token itself if it is not among them).

Terms:
* **legacy** (/v1/completions) — {"tokens", "token_logprobs", "top_logprobs", "text_offset"}: parallel lists,
  null for the first prompt token (nothing scores it); `text_offset` is where each token's text starts,
  counting the decoded token strings from the start of the choice's text.
* **chat** (/v1/chat/completions) — {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.

JSON has no -inf: a token outside the request's top-k / top-p set (log-probability -inf) reads -9999.0, as in
vLLM.
"""

from __future__ import annotations

FLOOR = -9999.0


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _value(x: float) -> float:
    return max(x, FLOOR)


def _top(d: dict[int, float], n: int) -> list[tuple[int, float]]:
    return list(d.items())[:n]


def legacy(tokenizer, token_ids: list[int], logprobs: list[dict[int, float] | None], n: int, offset: int
           ) -> tuple[dict, int]:
    """-> (the legacy object for these tokens, the text offset after them)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, d in zip(token_ids, logprobs, strict=True):
        text = token_text(tokenizer, tok)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if d is None else _value(d[tok]))
        out["top_logprobs"].append(None if d is None else
                                   {token_text(tokenizer, t): _value(v) for t, v in _top(d, n)})
    return out, offset


def chat(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], n: int) -> list[dict]:
    """-> the `content` list for these tokens."""

    def entry(tok: int, value: float) -> dict:
        text = token_text(tokenizer, tok)
        return {"token": text, "logprob": _value(value), "bytes": list(text.encode("utf-8"))}

    return [{**entry(tok, d[tok]), "top_logprobs": [entry(t, v) for t, v in _top(d, n)]}
            for tok, d in zip(token_ids, logprobs, strict=True)]
