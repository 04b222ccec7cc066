"""The `sparkspec` response extension: how each output token came, for the playground and for anyone studying
speculation on real traffic. Opt-in per request (`"sparkspec": {"token_sources": true}`); a choice then carries

    "sparkspec": {"token_sources": [...], "token_texts": [...], "spec": {...}}

* `token_sources` — one int per output token (`sparkspec.engine.sequence.TokenSource`): j in 1..k for a draft
  accepted at draft position j, -1 for the bonus token (every draft of the step accepted), 0 for a token the
  target sampled itself (a plain step, the first token, the correction after a rejection);
* `token_texts` — each token's text: the pieces concatenate to the output text (before a stop string cuts it),
  so a client can colour the text token by token. A token that ends inside a UTF-8 character has the text ""
  and the token that completes the character carries it. null without a tokenizer;
* `spec` — the request's counters so far: `steps` (verify steps with >= 1 draft), `drafted`, `accepted`,
  `accepted_per_position` (steps whose draft j was accepted). τ = (accepted + steps) / steps.

A streamed chunk carries the tokens produced since the choice's previous chunk; the non-streamed choice carries
all of them."""

from __future__ import annotations

from sparkspec.tokenizer import IncrementalDetokenizer


class Provenance:
    """One choice's extension state: a detokenizer of its own fed one token at a time (the engine's feeds a
    step's tokens at once, which gives no per-token boundaries)."""

    def __init__(self, tokenizer):
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None

    def texts(self, token_ids: list[int], finished: bool) -> list[str] | None:
        if self.detok is None:
            return None
        pieces = [self.detok.feed([t]) for t in token_ids]
        if finished:
            tail = self.detok.flush()
            if pieces:
                pieces[-1] += tail
        return pieces

    def extension(self, out, start: int, end: int) -> dict:
        """The object for output tokens start..end of `out` (a RequestOutput)."""
        m = out.metrics
        spec = {"steps": m.get("spec_steps", 0), "drafted": m.get("spec_drafted", 0),
                "accepted": m.get("spec_accepted", 0),
                "accepted_per_position": list(m.get("spec_accepted_per_position", []))}
        return {"token_sources": list(out.token_sources[start:end]),
                "token_texts": self.texts(out.token_ids[start:end], out.finished and end == len(out.token_ids)),
                "spec": spec}
