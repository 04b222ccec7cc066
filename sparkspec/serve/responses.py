"""Response bodies and SSE chunks of the two generation endpoints, for a request of n choices.

A choice's stream sends, per engine output, the text that became visible since its last chunk and the logprobs
of the tokens produced since then (the two need not line up: text is held back while it may end in a stop
string or a split UTF-8 character, logprobs are not). With `echo`, a choice's first chunk starts with the
prompt (and its logprobs). With the `sparkspec` extension asked for, each choice also carries the provenance of
its tokens (`provenance.py`), in the same token slices as the logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sparkspec.serve import logprobs as lp
from sparkspec.serve.provenance import Provenance


@dataclass
class ChoiceState:
    """What one choice's stream has sent: characters of text, output tokens, the legacy text offset."""

    text: int = 0
    tokens: int = 0
    offset: int = 0
    started: bool = False
    provenance: Provenance | None = None  # with the `sparkspec` extension, made by the view on first use


def usage(num_prompt: int, outs) -> dict:
    n_out = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": num_prompt, "completion_tokens": n_out, "total_tokens": num_prompt + n_out}


class View:
    object: str
    chunk_object: str

    def __init__(self, rid: str, model: str, tokenizer, prompt_ids: list[int], token_sources: bool = False):
        self.rid, self.model, self.tokenizer, self.prompt_ids = rid, model, tokenizer, prompt_ids
        self.token_sources = token_sources
        self.created = int(time.time())

    def with_provenance(self, choice: dict, out, tokens: slice, st: ChoiceState | None = None) -> dict:
        """Add the `sparkspec` extension to a choice when the request asked for it (and only then)."""
        if not self.token_sources:
            return choice
        st = st or ChoiceState()
        st.provenance = st.provenance or Provenance(self.tokenizer)
        end = len(out.token_ids) if tokens.stop is None else tokens.stop
        return {**choice, "sparkspec": st.provenance.extension(out, tokens.start or 0, end)}

    def has_news(self, text: str, tokens: slice, finished: bool) -> bool:
        """A chunk is worth sending: new text, a finish, or (with the extension) new tokens, whose provenance the
        client waits for even while their text is held back."""
        return bool(text) or finished or (self.token_sources and tokens.stop > tokens.start)

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self, outs) -> dict:
        return {**self.envelope(self.chunk_object, []), "usage": usage(len(self.prompt_ids), outs)}

    def final(self, outs) -> dict:
        choices = [self.choice(i, o) for i, o in enumerate(outs)]
        return {**self.envelope(self.object, choices), "usage": usage(len(self.prompt_ids), outs)}


class CompletionView(View):
    object = chunk_object = "text_completion"

    def __init__(self, rid, model, tokenizer, prompt_ids, prompt_text: str, echo: bool, logprobs: int | None,
                 token_sources: bool = False):
        super().__init__(rid, model, tokenizer, prompt_ids, token_sources)
        self.prompt_text, self.echo, self.logprobs = prompt_text, echo, logprobs

    def logprob_obj(self, out, tokens: slice, with_prompt: bool, offset: int) -> tuple[dict | None, int]:
        if self.logprobs is None:
            return None, offset
        ids, values = out.token_ids[tokens], (out.logprobs or [])[tokens]
        if with_prompt:
            ids, values = self.prompt_ids + ids, (out.prompt_logprobs or [None] * len(self.prompt_ids)) + values
        return lp.legacy(self.tokenizer, ids, values, self.logprobs, offset)

    def choice(self, i: int, out) -> dict:
        logprobs, _ = self.logprob_obj(out, slice(None), self.echo, 0)
        text = (self.prompt_text if self.echo else "") + out.text
        return self.with_provenance({"index": i, "text": text, "logprobs": logprobs,
                                     "finish_reason": out.finish_reason}, out, slice(0, None))

    def chunk(self, i: int, out, st: ChoiceState) -> dict | None:
        prefix = self.echo and not st.started
        text = (self.prompt_text if prefix else "") + out.text[st.text :]
        new = slice(st.tokens, len(out.token_ids))
        logprobs, st.offset = self.logprob_obj(out, new, prefix, st.offset)
        st.started, st.text, st.tokens = True, len(out.text), new.stop
        if not (self.has_news(text, new, out.finished) or (logprobs and logprobs["tokens"])):
            return None
        choice = {"index": i, "text": text, "logprobs": logprobs,
                  "finish_reason": out.finish_reason if out.finished else None}
        return self.envelope(self.chunk_object, [self.with_provenance(choice, out, new, st)])


class ChatView(View):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid, model, tokenizer, prompt_ids, logprobs: int | None, token_sources: bool = False):
        super().__init__(rid, model, tokenizer, prompt_ids, token_sources)
        self.logprobs = logprobs

    def logprob_obj(self, out, tokens: slice) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": lp.chat(self.tokenizer, out.token_ids[tokens], out.logprobs[tokens], self.logprobs)}

    def choice(self, i: int, out) -> dict:
        choice = {"index": i, "message": {"role": "assistant", "content": out.text},
                  "logprobs": self.logprob_obj(out, slice(None)), "finish_reason": out.finish_reason}
        return self.with_provenance(choice, out, slice(0, None))

    def chunk(self, i: int, out, st: ChoiceState) -> dict | None:
        text = out.text[st.text :]
        new = slice(st.tokens, len(out.token_ids))
        logprobs = self.logprob_obj(out, new)
        st.text, st.tokens = len(out.text), new.stop
        if not (self.has_news(text, new, out.finished) or (logprobs and logprobs["content"])):
            return None
        delta = {"content": text}
        if not st.started:
            delta, st.started = {"role": "assistant", **delta}, True
        choice = {"index": i, "delta": delta, "logprobs": logprobs,
                  "finish_reason": out.finish_reason if out.finished else None}
        return self.envelope(self.chunk_object, [self.with_provenance(choice, out, new, st)])
